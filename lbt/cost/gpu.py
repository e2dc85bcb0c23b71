"""A worker's step time on a GPU you do not have: the model's FLOPs over a published peak rate.

    step = FLOPs of one forward + backward at batch b / (peak dense rate x utilisation)

FLOPs are counted by torch's FlopCounterMode (matmuls and convolutions; elementwise work, norms and
the optimizer step are left out). The peak rates are the vendors' dense figures, without the 2:4
structured sparsity their datasheets often quote first (half of those). Nothing runs at peak: the
utilisation (model FLOPs utilisation, MFU) is an assumption the output states. Large transformers
reach 35-55% in bf16 (PaLM, Chowdhery et al. 2022: 46%; Megatron-LM, Narayanan et al. 2021: 52%);
small models at small batches much less, since a step of a few dozen kernels each too small to fill
the GPU is bound by launches (a few us each) rather than FLOPs. Measure a real step where you can
(`lbt plan plan.step_ms=MS`).

`fp32` is the GPU's CUDA-core FP32 rate: torch's default matmuls (torch.backends.cuda.matmul.allow_tf32
is False); its convolutions may use TF32 (torch.backends.cudnn.allow_tf32 is True) and run faster.
`tf32`, `bf16` and `fp16` are tensor-core rates (trainer.precision=bf16/fp16: autocast).
"""

from __future__ import annotations

from dataclasses import dataclass

# MFU assumed when none is given: the middle of what large-model training reports (see above).
DEFAULT_UTILIZATION = 0.4
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
# Below this a predicted step is launch-bound on any GPU, whatever its FLOPs say.
LAUNCH_BOUND_S = 1e-3


@dataclass(frozen=True)
class Gpu:
    name: str
    label: str
    tflops: dict[str, float]  # dense peak, TFLOPS, per precision (absent: the GPU has no such unit)
    source: str


# Dense peak TFLOPS (no sparsity), from each vendor's datasheet.
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("v100", "NVIDIA V100 SXM2", {"fp32": 15.7, "fp16": 125.0},
            "NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7, tensor FP16 125 TFLOPS; no bf16 or tf32"),
        Gpu("a10", "NVIDIA A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
            "NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16/FP16 125 TFLOPS dense (250 with sparsity)"),
        Gpu("l4", "NVIDIA L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
            "NVIDIA L4 datasheet: FP32 30.3, TF32 60, BF16/FP16 121 TFLOPS dense (120/242 with sparsity)"),
        Gpu("l40s", "NVIDIA L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
            "NVIDIA L40S datasheet: FP32 91.6, TF32 183, BF16/FP16 362 TFLOPS dense (366/733 with sparsity)"),
        Gpu("a100", "NVIDIA A100 SXM", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
            "NVIDIA A100 datasheet: FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS dense (312/624 with sparsity)"),
        Gpu("h100", "NVIDIA H100 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
            "NVIDIA H100 datasheet (SXM5): FP32 67, TF32 494.7, BF16/FP16 989.4 TFLOPS dense "
            "(989/1,979 with sparsity)"),
        Gpu("h200", "NVIDIA H200 SXM", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
            "NVIDIA H200 datasheet (SXM): the H100's compute, FP32 67, TF32 494.7, BF16/FP16 989.4 TFLOPS dense "
            "(989/1,979 with sparsity); more and faster memory"),
        Gpu("mi300x", "AMD Instinct MI300X", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4},
            "AMD Instinct MI300X datasheet: FP32 vector 163.4, TF32 653.7, BF16/FP16 1,307.4 TFLOPS dense"),
    )
}


# Memory per GPU, GB, from the same datasheets (the larger model where a GPU comes in two: V100 32 GB, A100 80 GB).
MEMORY_GB = {"v100": 32.0, "a10": 24.0, "l4": 24.0, "l40s": 48.0, "a100": 80.0, "h100": 80.0, "h200": 141.0,
             "mi300x": 192.0}


def gpu_seconds(flops: float, gpu: Gpu, precision: str, utilization: float) -> float:
    """Seconds `flops` take on `gpu` at `precision` running at `utilization` of its dense peak."""
    if precision not in gpu.tflops:
        have = ", ".join(gpu.tflops)
        raise ValueError(f"{gpu.label} has no {precision} rate in its datasheet (it has {have}): "
                         f"choose plan.precision={' or '.join(gpu.tflops)}")
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    return flops / (gpu.tflops[precision] * 1e12 * utilization)
