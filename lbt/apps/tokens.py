"""`lbt tokens TEXT_FILE OUT_DIR`: a token folder for data=tokens from any file, with a byte-level tokenizer."""

from __future__ import annotations

import argparse

from lbt.apps.errors import fail
from lbt.data.tokens import write_byte_tokens
from lbt.errors import ConfigError

EPILOG = """Each byte is one token (uint16 ids, vocabulary 256): no tokenizer to download. Then
  lbt train data=tokens data.path=OUT_DIR
reads train.bin and val.bin, and vocab_size and dtype from meta.json. For your own tokenizer, write
np.array(ids, dtype=np.uint16).tofile("OUT_DIR/train.bin") (uint32 past 65,536 tokens) and the same
for val.bin: docs/language-models.md."""


def tokens_command(args: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lbt tokens", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write train.bin, val.bin and meta.json (nanoGPT's format) from TEXT_FILE, one token per byte.")
    parser.error = lambda message: fail(f"lbt tokens: {message}")  # type: ignore[method-assign]
    parser.add_argument("text_file")
    parser.add_argument("out_dir")
    parser.add_argument("--val-fraction", type=float, default=0.1,
                        help="the file's last part that becomes val.bin (default 0.1)")
    options = parser.parse_args(args)
    try:
        counts = write_byte_tokens(options.text_file, options.out_dir, options.val_fraction)
    except ConfigError as error:
        fail(str(error))
    except OSError as error:
        fail(f"{options.out_dir}: cannot write it ({error.strerror or error})")
    print(f"wrote {options.out_dir}: train.bin {counts['train.bin']:,} tokens, val.bin {counts['val.bin']:,} "
          f"tokens (uint16, vocabulary 256, meta.json); train with: lbt train data=tokens data.path={options.out_dir}")
