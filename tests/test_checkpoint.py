"""The Checkpointer's fault paths on a small tree, in process: what is refused, what is set
aside, and what is left alone."""

import jax.numpy as jnp
import numpy as np
import pytest

from reasoner.engine.checkpoint import CheckpointDamaged, CheckpointError, Checkpointer


def _tree(scale, width=4):
  return {"lora": {"a": jnp.full((3, width), scale, jnp.float32)}, "step": jnp.int32(scale)}


def _saved(tmp_path, steps=(1, 2)):
  ck = Checkpointer(tmp_path / "checkpoints", keep=5)
  for s in steps:
    ck.save(s, _tree(float(s)), {"position": s})
  return ck


def test_damaged_data_json_is_set_aside_and_the_one_before_restored(tmp_path):
  ck = _saved(tmp_path)
  (tmp_path / "checkpoints" / "2" / "data" / "metadata").write_text('{"posit')  # cut short
  said = []
  step, state, data = ck.restore_latest(_tree(0.0), said.append)
  assert step == 1 and data == {"position": 1}
  np.testing.assert_array_equal(state["lora"]["a"], np.full((3, 4), 1.0, np.float32))
  aside = tmp_path / "checkpoints" / "corrupt-2"
  assert said == [f"checkpoint {tmp_path / 'checkpoints' / '2'} cannot be read: "
                  f"{said[0].split('cannot be read: ')[1].split(';')[0]}; moved to {aside}"]
  assert (aside / "data" / "metadata").read_text() == '{"posit'  # kept as it was
  assert ck.all_steps() == [1]
  ck.save(2, _tree(5.0), {"position": 5})  # the step can be saved again
  assert ck.restore_latest(_tree(0.0))[0] == 2 and aside.is_dir()


def test_a_read_only_source_is_never_changed(tmp_path):
  _saved(tmp_path)
  (tmp_path / "checkpoints" / "2" / "data" / "metadata").write_text("")
  said = []
  ro = Checkpointer(tmp_path / "checkpoints", 1, read_only=True)
  assert ro.restore_latest(_tree(0.0), said.append)[0] == 1
  assert len(said) == 1 and "moved" not in said[0]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]


def test_other_shapes_are_refused_before_any_read_and_nothing_moves(tmp_path):
  ck = _saved(tmp_path)
  with pytest.raises(CheckpointError, match=r"checkpoints/2 does not fit this run: lora/a is "
                     r"\(3, 4\) float32 there and \(3, 8\) float32 here") as e:
    ck.restore_latest(_tree(0.0, width=8))
  assert not isinstance(e.value, CheckpointDamaged)
  assert ck.all_steps() == [1, 2]


def test_a_failure_that_is_not_the_files_leaves_the_checkpoint_alone(tmp_path, monkeypatch):
  ck = _saved(tmp_path)

  def out_of_memory(*a, **k):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1.2G on TPU_0")

  monkeypatch.setattr(ck._mngr, "restore", out_of_memory)
  with pytest.raises(CheckpointError, match="checkpoints/2 cannot be read: RuntimeError: "
                     "RESOURCE_EXHAUSTED: Out of memory") as e:
    ck.restore_latest(_tree(0.0))
  assert not isinstance(e.value, CheckpointDamaged)
  assert ck.all_steps() == [1, 2] and not list((tmp_path / "checkpoints").glob("corrupt*"))


def test_unretrieved_failures_of_a_damaged_read_are_dropped_and_others_kept(caplog):
  """A restore of a damaged checkpoint fails on one array's read while the others fail in
  tasks nobody awaits; asyncio logs those with a traceback when they are collected (how many
  depends on timing). Those are dropped (`restore` reported the damage in one line); any other
  unretrieved failure still reaches the log."""
  import asyncio
  import gc

  async def fail(message):
    raise ValueError(message)

  def orphan(message):
    loop = asyncio.new_event_loop()
    task = loop.create_task(fail(message))
    loop.run_until_complete(asyncio.sleep(0.01))
    del task
    gc.collect()
    loop.close()

  with caplog.at_level("ERROR", logger="asyncio"):
    orphan('OUT_OF_RANGE: Error reading "lora.kernel_lora_b.value/.zarray" in OCDBT database')
    orphan("something else broke")
  said = [r.getMessage() + str(r.exc_info and r.exc_info[1]) for r in caplog.records]
  assert any("something else broke" in m for m in said), said
  assert not any("OUT_OF_RANGE" in m for m in said), said
