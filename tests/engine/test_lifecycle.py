"""The engine lifecycle (engine/lifecycle.py): what its features are told around a checkpoint load."""

from __future__ import annotations

from pathlib import Path

from ds_nvfp4.engine.lifecycle import Feature, Lifecycle, LoadContext


class _Recorder(Feature):
    name = "recorder"

    def __init__(self) -> None:
        self.loads: list[LoadContext] = []

    def after_load(self, state, load: LoadContext) -> None:
        self.loads.append(load)


def test_a_load_without_a_tag_tells_the_features_the_tag_latest_names(tmp_path: Path) -> None:
    """``engine.load_checkpoint(dir)`` (no tag, as launch/train.py --resume calls it): DeepSpeed loads the tag
    ``latest`` names, and the features must look for their state (RNG, spike guard, lr_decay) in that tag's folder,
    not in a folder called "None"."""
    (tmp_path / "latest").write_text("step300\n")
    rec = _Recorder()
    life = Lifecycle(engine=None, state=None, features=[rec])

    def deepspeed_load(load_dir, tag, *args, **kwargs):  # what DeepSpeed returns after loading something
        return f"{load_dir}/step300", {"step": 300}

    out = life.run_load(deepspeed_load, tmp_path, None)
    assert out[1] == {"step": 300}
    assert rec.loads == [LoadContext(str(tmp_path), "step300")]
    life.run_load(deepspeed_load, tmp_path, "step100")
    assert rec.loads[-1].tag == "step100"


def test_nothing_loaded_tells_the_features_nothing(tmp_path: Path) -> None:
    rec = _Recorder()
    Lifecycle(engine=None, state=None, features=[rec]).run_load(lambda d, t: (None, None), tmp_path, None)
    assert rec.loads == []
