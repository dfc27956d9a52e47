"""Files that hold a model: checkpoints and weights-only exports.

``files`` writes any file whole or not at all; ``digest`` is the SHA-256 a checkpoint carries and an export records;
``checkpoint`` reads checkpoints as data only (``read_checkpoint``) and is the Lightning ``SafeCheckpointIO``;
``runs`` finds a run's ``last.ckpt`` in a checkpoint folder; ``file_fits`` says whether a file fits a model;
``load`` builds a model from any of these files (the class to build is passed in: nothing here imports
``ltcx.lm``); ``export`` writes weights-only exports.
"""

from ltcx.persist.checkpoint import SafeCheckpointIO, read_checkpoint
from ltcx.persist.digest import DIGEST_KEY, content_digest
from ltcx.persist.export import export_model
from ltcx.persist.files import atomic_copy, atomic_save, remove_stale_temps
from ltcx.persist.load import EXPORT_CONFIG, EXPORT_FORMAT, EXPORT_WEIGHTS, load_exported, load_language_model
from ltcx.persist.runs import checkpoint_in_folder, latest_last_checkpoint, run_versions

__all__ = ["SafeCheckpointIO", "read_checkpoint", "DIGEST_KEY", "content_digest", "EXPORT_CONFIG", "EXPORT_FORMAT",
           "EXPORT_WEIGHTS", "export_model", "load_exported", "atomic_copy", "atomic_save", "remove_stale_temps",
           "load_language_model", "checkpoint_in_folder", "latest_last_checkpoint", "run_versions"]
