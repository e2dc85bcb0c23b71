"""What a step costs in time and bytes, as formulas: data parallelism (data_parallel.py), data x tensor
parallelism (tensor_parallel.py) and a step's compute on a GPU preset from its published peak (gpu.py).
`lbt plan` evaluates them; the trainer counts bytes with them."""
