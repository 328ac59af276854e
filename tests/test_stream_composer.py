"""Resumption state through a real Composer checkpoint: stop at batch 3, resume, same batches."""

from __future__ import annotations

import logging

import pytest

from tests.exportkit import make_export

logging.getLogger("streaming").setLevel(logging.ERROR)


def _trainer(root, tmp, seen, **kw):
    import torch
    from composer import Callback, Trainer
    from composer.models import ComposerModel
    from streaming import StreamingDataLoader
    from streaming.base.util import clean_stale_shared_memory

    from prx_data.stream.dataset import BucketedDataset

    class Tiny(ComposerModel):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, batch):
            return batch["image"].float().mean() * self.w

        def loss(self, outputs, batch):
            return (outputs - 1.0) ** 2

    class Record(Callback):
        def batch_start(self, state, logger):
            seen.append(list(state.batch["id"]))

    clean_stale_shared_memory()
    ds = BucketedDataset(root, tier=512, batch_size=4, small_buckets="drop")
    loader = StreamingDataLoader(ds, batch_size=4, num_workers=0)
    model = Tiny()
    return Trainer(
        model=model,
        train_dataloader=loader,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
        max_duration="6ba",
        device="cpu",
        callbacks=[Record()],
        save_folder=str(tmp / "ckpt"),
        save_interval="3ba",
        save_filename="ba{batch}.pt",
        progress_bar=False,
        log_to_console=False,
        **kw,
    )


@pytest.mark.slow
def test_composer_checkpoint_resumes_the_stream(tmp_path):
    root = make_export(str(tmp_path / "ex"), {"512/1.000": 24, "512/0.500": 16}).root
    full: list = []
    t = _trainer(root, tmp_path / "a", full)
    t.fit()
    t.close()
    resumed: list = []
    t = _trainer(root, tmp_path / "b", resumed, load_path=str(tmp_path / "a" / "ckpt" / "ba3.pt"))
    t.fit()
    t.close()
    assert len(full) == 6 and resumed == full[3:]
