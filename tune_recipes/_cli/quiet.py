"""Silence third-party messages we cannot act on; ours and everything else stay.

Installed on ``import tune_recipes`` (the CLI imports it first; a recipe run by ``tune run``
executes in that process, and torchrun children start through ``tune_recipes._cli.launch``),
so the filters are in place before torchao, torchtune or torchdata are imported. Each filter
names one message and where it comes from:

- torchao 0.15.0 (``torchao/__init__.py``) logs "Skipping import of cpp extensions due to
  incompatible torch version ..." at import on any torch it was not built for (2.13 here). Its C++
  kernels are optional; nothing we run needs them.
- torchdata 0.11.0's StatefulDataLoader calls ``torch.set_vital``, deprecated in torch 2.13: a
  UserWarning on every run.
- torch's AOT autograd cache warns "OptimState8bit does not implement _stable_hash_for_caching"
  whenever it compiles torchao's 8-bit optimizer update (the 3B and 8B full configs' AdamW8bit):
  a request to torchao's authors; the update compiles and runs the same.
- torchtune 0.6.1 shares one logger (``torchtune.utils._logging``) and its modules set it to DEBUG
  on import, so its debug lines ("Setting manual seed to local seed 0 ...") print. We drop its
  DEBUG records only; its INFO (checkpoint saved to ...) and warnings still print, the INFO
  from the first process of a torchrun launch only (the others repeat it: "Loading the recipe
  state using: ..." once a process).

``TUNE_RECIPES_VERBOSE=1`` turns all of this off.
"""

import logging
import os
import warnings

TORCHAO_CPP_EXTENSIONS = "Skipping import of cpp extensions"
SET_VITAL = "'set_vital' is deprecated"
OPTIM_STATE_HASH = "OptimState8bit does not implement _stable_hash_for_caching"


class _DropTorchaoCppNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TORCHAO_CPP_EXTENSIONS)


class _DropDebugAndRepeatedInfo(logging.Filter):
    # A filter, not setLevel: torchtune modules call setLevel("DEBUG") on the shared logger
    # each time one is imported, which would undo a level set here.
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO:
            return False
        # Read at each record: a rank's environment is set before it imports anything, but
        # tests and `tune` itself run several roles in one process.
        other_rank = ("TORCHELASTIC_RUN_ID" in os.environ
                      and os.environ.get("RANK", "0") != "0")
        return record.levelno >= logging.WARNING or not other_rank


# One instance each: addFilter ignores an instance already attached, so installing twice is
# harmless.
_TORCHAO = _DropTorchaoCppNotice()
_TORCHTUNE = _DropDebugAndRepeatedInfo()


def install() -> None:
    if os.environ.get("TUNE_RECIPES_VERBOSE", "") not in ("", "0"):
        return
    logging.getLogger("torchao").addFilter(_TORCHAO)
    logging.getLogger("torchtune.utils._logging").addFilter(_TORCHTUNE)
    warnings.filterwarnings("ignore", message=SET_VITAL, category=UserWarning)
    warnings.filterwarnings("ignore", message=OPTIM_STATE_HASH, category=UserWarning)
