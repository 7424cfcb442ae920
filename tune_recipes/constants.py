"""Values shared by the library's layers; imports nothing, so any module may import it."""

# Label value the loss ignores (padding, masked prompt tokens): torch's and torchtune's default.
CROSS_ENTROPY_IGNORE_INDEX = -100

# The torch.profiler annotation around a checkpoint save (checkpointing/writer.py), which
# scripts/trace_summary.py looks for: a profiled window holding one counts the save as training.
CHECKPOINT_SAVE_EVENT = "tune_recipes.checkpoint_save"

# A run's checkpoint folders in output_dir (training/checkpointing/io.py writes and reads them;
# plotting.py recognizes a run's output_dir by them): one per epoch, one per mid-epoch step.
EPOCH_DIR_PATTERN = r"^epoch_(\d+)$"
STEP_DIR_PATTERN = r"^step_(\d+)$"
# Written by `tune download` (torchtune's) into the folder it downloaded a hub repo to.
DOWNLOADED_REPO_FILE = "original_repo_id.json"

# The collate of unpacked batches unless a config names another (torchtune's: pad each row).
DEFAULT_COLLATE = "torchtune.data.padded_collate_sft"
