"""The ground floor, below data and checkpoints: errors a user can cause (UserError), atomic files, a run's
file names, its lock, replacing directories whole, the files a command writes, signals (docs/operations.md)."""

from __future__ import annotations

from .files import (UserError, error_text, json_text, read_json, say, user_errors, write_error, write_json_atomic,
                    write_text_atomic)
from .layout import (AVERAGED_FILE, CHECKPOINTS, CONFIG_FILE, CURVES_FILE, IMPORTED_FILE, LOCK_FILE, MODEL_FILE,
                     PROVENANCE_FILE, RESULTS_FILE, TENSORBOARD, read_experiment, read_model_config)
from .lock import RunLock
from .replace import (KIND_FILE, KINDS, PROGRAM_KINDS, PROOF_FILE, check_destination, check_export, derive,
                      export_digests, kind_of, remove, swap_in)
from .signals import Interrupted, StopSignals, exit_status, interruptible
