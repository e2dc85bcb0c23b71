"""Where lbt's Hydra config tree lives."""

from pathlib import Path


def conf_dir() -> Path:
    package = Path(__file__).resolve().parent
    source_checkout = package.parent / "conf"  # repo layout: conf/ beside lbt/
    if (source_checkout / "config.yaml").is_file():
        return source_checkout
    return package / "conf"  # installed wheel: conf/ packaged as lbt/conf
