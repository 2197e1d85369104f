"""The data loader of optllm's task files (lm-eval's ``custom_dataset``): JSON lines named
in ``dataset_kwargs.data_files``, read relative to this folder."""

from __future__ import annotations

from pathlib import Path


def load(data_files: dict[str, str], **_metadata):
    """A DatasetDict with one split per entry of data_files ({split: file name}); lm-eval
    also passes the task's metadata (version, model arguments), which is not needed."""
    import datasets

    here = Path(__file__).resolve().parent
    files = {split: str(here / name) for split, name in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
