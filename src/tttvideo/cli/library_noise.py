"""Lines that third-party libraries print on import, dropped from the command's output by default.

Each is a warning from a logger of a library we import lazily (transformers and diffusers pull in torchao when it is
installed), not about anything the user did:

- torchao, on import, tries every compiled extension it ships and logs `Failed to load .../_C_mxfp8...so: ...`
  for each one this GPU or torch build cannot use (it then runs without them);
- torch's pytree logs `<enum 'KernelPreference'> is an Enum subclass and is now natively supported ...` (and the
  same for `ScaleCalculationMode`) when torchao registers its enums the way older torch versions needed;
- diffusers logs `Unable to import `torchao` Tensor objects ...` when that torchao lacks a class it looks for.

Only records matching these messages on these loggers are dropped (a logging filter on each logger); everything
else they log, and every Python warning, still shows. `TTTV_VERBOSE=1` keeps them all.
"""

from __future__ import annotations

import logging
import os

# logger name -> message fragments whose records are dropped
NOISE: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
}
VERBOSE_ENV = "TTTV_VERBOSE"


class _DropNoise(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a record that cannot be formatted is not ours to judge
            return True
        return not any(f in text for f in self.fragments)


def quiet_library_noise() -> None:
    """Install the filters (once per process) unless TTTV_VERBOSE is set to something other than 0 / empty."""
    if os.environ.get(VERBOSE_ENV, "").strip() not in ("", "0"):
        return
    for name, fragments in NOISE.items():
        logger = logging.getLogger(name)  # the same object the library gets when it is imported later
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(fragments))
