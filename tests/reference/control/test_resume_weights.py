"""A resumed run's starting weights (`layout.resumed_weights`): the version its run published for the checkpoint,
or, where the run was killed between writing the checkpoint and publishing that version, one published from the
checkpoint (the engines would otherwise fail to start on a missing directory)."""

from __future__ import annotations

import torch

from reference.control.config import load_train_config
from reference.control.layout import Checkpoint, resumed_weights
from reference.model import build_model, load_checkpoint, tiny_config
from reference.tasks import make_task
from reference.trainer.handoff import LATEST_FILE, publish_weights, version_dir, write_weights

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 64}  # fmt: skip


def _checkpoint(tmp_path, task, seed: int) -> tuple[Checkpoint, torch.nn.Module]:
    """A trainer checkpoint's weights (the hand-off format, no tokenizer) of step 1."""
    model = build_model(tiny_config(task.tokenizer.vocab_size, **SMALL), seed=seed)
    path = tmp_path / "checkpoints" / "step-00000001"
    path.mkdir(parents=True)
    write_weights(model.state_dict(), model.config, path, metadata={"step": "1"})
    return Checkpoint(1, path), model


def test_a_version_the_run_never_published_is_published_from_its_checkpoint(tmp_path):
    cfg, task = load_train_config(None, []), make_task("math")
    checkpoint, model = _checkpoint(tmp_path, task, seed=1)
    root = tmp_path / "weights"
    publish_weights(build_model(model.config, seed=0).state_dict(), model.config, root, 0, task.tokenizer)

    path = resumed_weights(cfg, task, root, checkpoint)

    assert path == str(version_dir(root, 1))
    loaded, tokenizer = load_checkpoint(path)
    assert tokenizer.vocab_size == task.tokenizer.vocab_size
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert (root / LATEST_FILE).read_text().strip() == "1"


def test_a_published_version_is_used_as_it_is(tmp_path):
    cfg, task = load_train_config(None, []), make_task("math")
    checkpoint, model = _checkpoint(tmp_path, task, seed=1)
    root = tmp_path / "weights"
    published = publish_weights(model.state_dict(), model.config, root, 1, task.tokenizer).path
    before = {f.name: f.stat().st_mtime_ns for f in published.iterdir()}

    assert resumed_weights(cfg, task, root, checkpoint) == str(published)
    assert {f.name: f.stat().st_mtime_ns for f in published.iterdir()} == before
