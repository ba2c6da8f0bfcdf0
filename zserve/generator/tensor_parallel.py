"""Tensor parallel generation: one engine group of N processes joined by torch.distributed (gloo on a CPU,
nccl on CUDA, with a gloo group beside it for the step broadcasts).

Rank 0 is the engine process its supervisor started: it talks to the broker, schedules, samples and drives
every step. Ranks 1..N-1 are its children, started when it loads the model and dying with it (PDEATHSIG).
Every rank runs its shard of the model: ours for the Llama family (``llama.py``: each rank loads the whole
checkpoint and keeps its heads and MLP columns, an all-reduce after ``o_proj`` and ``down_proj``), else
Hugging Face's with transformers' tensor-parallel plan for it (``tp_plan="auto"``: the same split, the logits
gathered); each rank's KV cache holds its own key/value heads (``kv_heads / N``). For each step rank 0
broadcasts the packed inputs and the step metadata (``send_step``); the followers run the same forward pass
(``follow``) and drop its logits. Followers keep no scheduler and no sequences: the only state they hold is
their slice of the weights and of the KV cache.

A follower that dies breaks the group (the next collective would hang or fail): rank 0 exits at once, so its
supervisor restarts the whole group, and the broker re-dispatches its sequences as for any lost engine.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zserve.generator.attention import StepMeta, Uploader
from zserve.generator.step_core import forward, kv_heads, paged_cache_for

log = logging.getLogger("zserve.tensor_parallel")

_STEP, _STOP = 1, 2
_HEADER = 6  # op, tokens, sequences, decodes, KV slots, sampled rows


def check_divisible(config: Any, size: int) -> None:
    """Heads are what is split: ``size`` must divide the model's attention heads and key/value heads."""
    heads, kv = config.num_attention_heads, kv_heads(config)
    if size < 1:
        raise ValueError(f"tensor_parallel must be 1 or more, not {size}")
    if heads % size or kv % size:
        raise ValueError(
            f"tensor_parallel {size} must divide the model's {heads} attention heads and {kv} key/value "
            "heads (they are what is split across ranks)"
        )


@dataclass(slots=True)
class GroupSpec:
    """What a follower needs to join: the rendezvous file and how to load the model."""

    size: int
    store: str  # a file:// rendezvous (no port to race for)
    path: str
    dtype: str
    device: str
    model_impl: str = "auto"  # see llama.own_model


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


_ENV = ("GLOO_SOCKET_IFNAME", "RANK", "LOCAL_RANK", "WORLD_SIZE")  # what joining sets (transformers reads them)


def _join(rank: int, spec: GroupSpec) -> Any:
    """Join the process group; returns the group the step broadcasts travel on (always gloo: CPU tensors)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, whatever the hostname resolves to
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(spec.size))
    backend = _backend(spec.device)
    if backend == "nccl":  # each rank its own GPU: NCCL's communicators and every later allocation follow it
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{spec.store}", rank=rank, world_size=spec.size)
    return dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")


def load_sharded(spec: GroupSpec) -> Any:
    """This rank's shard of the model (the process group must be joined)."""
    from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig

    from zserve.generator.llama import LlamaFamily, unsupported

    config = AutoConfig.from_pretrained(spec.path)
    if spec.model_impl == "zserve" or (spec.model_impl == "auto" and unsupported(config) is None):
        rank = dist.get_rank()
        device = f"cuda:{rank}" if spec.device.startswith("cuda") else spec.device
        whole = AutoModelForCausalLM.from_pretrained(spec.path, dtype=getattr(torch, spec.dtype)).to(device)
        return LlamaFamily.from_hf(whole, rank, spec.size, dist.group.WORLD)
    parallel = DistributedConfig(tp_plan="auto", tp_size=spec.size)  # the model's own plan (its config's)
    return AutoModelForCausalLM.from_pretrained(
        spec.path, dtype=getattr(torch, spec.dtype), distributed_config=parallel
    ).eval()


class TensorParallelGroup:
    """Rank 0's side: the followers it started and the broadcasts that drive them."""

    def __init__(
        self, spec: GroupSpec, followers: list[subprocess.Popen], control: Any, store_dir: str,
        saved_env: dict[str, str | None],
    ) -> None:  # fmt: skip
        self.spec = spec
        self.size = spec.size
        self._followers = followers
        self._control = control
        self._store_dir = store_dir
        self._closing = False
        self._saved_env = saved_env  # what joining the group changed in os.environ, put back at close
        for proc in followers:
            threading.Thread(target=self._watch, args=(proc,), name="tp-watch", daemon=True).start()
        atexit.register(self.close)

    @classmethod
    def start(cls, size: int, path: str, *, dtype: str, device: str, model_impl: str = "auto") -> TensorParallelGroup:
        """Start ranks 1..size-1 and join the group as rank 0. The model path must be local (resolved)."""
        saved_env = {name: os.environ.get(name) for name in _ENV}
        store_dir = tempfile.mkdtemp(prefix="zserve-tp-")
        spec = GroupSpec(size, os.path.join(store_dir, "rendezvous"), path, dtype, device, model_impl)
        from zserve.transport import child_env  # here, not at the top: the GPU check imports us without zmq

        followers = []
        for rank in range(1, size):
            argv = ["--rank", str(rank), "--size", str(size), "--store", spec.store, "--path", path, "--dtype", dtype]
            argv += ["--device", device, "--model-impl", model_impl]
            followers.append(
                subprocess.Popen([sys.executable, "-m", "zserve.generator.tensor_parallel", *argv], env=child_env())
            )
        try:
            control = _join(0, spec)
        except BaseException:
            for proc in followers:
                proc.kill()
            shutil.rmtree(store_dir, ignore_errors=True)
            _restore(saved_env)
            raise
        log.info("tensor parallel group of %d ready (followers: pids %s)", size, [p.pid for p in followers])
        return cls(spec, followers, control, store_dir, saved_env)

    def _watch(self, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing:
            log.error("tensor parallel rank (pid %d) exited with %s: the group is broken, exiting", proc.pid, code)
            logging.shutdown()
            os._exit(1)  # collectives cannot go on; the supervisor restarts the whole group

    def init_cache(self, num_blocks: int, block_size: int, batched_decode: bool, native_decode: bool) -> None:
        """Tell the followers how to size their KV caches (rank 0 decides: free memory differs per device)."""
        sizes = torch.tensor([num_blocks, block_size, int(batched_decode), int(native_decode)])
        dist.broadcast(sizes, 0, group=self._control)

    def forward(
        self, model: Any, ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta, sample_rows: list[int],
        batched_decode: bool, upload: Uploader,
    ) -> torch.Tensor:  # fmt: skip
        """One step on every rank; rank 0's logits. Any failure here leaves the ranks out of step (a follower
        may wait in a collective forever), so it ends the process: the supervisor restarts the group."""
        try:
            self._send_step(ids, positions, meta, sample_rows)
            return forward(model, ids, positions, meta, sample_rows, batched_decode=batched_decode, upload=upload)
        except Exception:
            log.exception("tensor parallel step failed: the group is out of step, exiting")
            logging.shutdown()
            os._exit(1)

    def _send_step(self, ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta, sample_rows: list[int]) -> None:
        header = torch.tensor(
            [_STEP, ids.shape[1], len(meta.context_lens), meta.num_decodes, sum(meta.context_lens), len(sample_rows)]
        )
        payload = torch.cat(
            [ids[0], positions[0], meta.slot_mapping, torch.tensor(meta.query_start), torch.tensor(meta.context_lens),
             *meta.slot_rows, torch.tensor(sample_rows, dtype=torch.long)]
        )  # fmt: skip
        dist.broadcast(header, 0, group=self._control)
        dist.broadcast(payload, 0, group=self._control)

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            dist.broadcast(torch.tensor([_STOP, 0, 0, 0, 0, 0]), 0, group=self._control)
            for proc in self._followers:
                proc.wait(timeout=30)
        except Exception:  # a broken group, or followers that do not stop: they go anyway
            for proc in self._followers:
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._store_dir, ignore_errors=True)
        _restore(self._saved_env)  # this process may load other models, alone


def _restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def receive_step(control: Any, block_size: int) -> tuple[torch.Tensor, torch.Tensor, StepMeta, list[int]] | None:
    """A follower's next step from rank 0, or None when the group stops."""
    header = torch.empty(_HEADER, dtype=torch.long)
    dist.broadcast(header, 0, group=control)
    op, t, n, decodes, slots, k = header.tolist()
    if op == _STOP:
        return None
    payload = torch.empty(3 * t + 2 * n + 1 + slots + k, dtype=torch.long)
    dist.broadcast(payload, 0, group=control)
    ids, positions, slot_mapping, query_start, context_lens, slot_rows, samples = payload.split(
        [t, t, t, n + 1, n, slots, k]
    )
    lengths = context_lens.tolist()
    rows = list(slot_rows.split(lengths))
    tables = [(r[::block_size] // block_size).to(torch.int32) for r in rows]  # blocks holding the context
    meta = StepMeta(block_size, slot_mapping, query_start.tolist(), lengths, decodes, tables, rows)
    return ids.unsqueeze(0), positions.unsqueeze(0), meta, samples.tolist()


def follow(rank: int, spec: GroupSpec) -> None:
    """A follower's life: join, load its shard, size its KV cache as rank 0 says, then mirror every step."""
    control = _join(rank, spec)
    model = load_sharded(spec)
    sizes = torch.empty(4, dtype=torch.long)
    dist.broadcast(sizes, 0, group=control)
    num_blocks, block_size, batched_decode, native_decode = sizes.tolist()
    paged_cache_for(model, num_blocks, block_size, spec.size, native_decode=bool(native_decode))
    upload = Uploader(model.device)
    with torch.inference_mode():
        while (step := receive_step(control, block_size)) is not None:
            forward(model, *step, batched_decode=bool(batched_decode), upload=upload)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A tensor parallel follower rank (started by rank 0, not by hand).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-impl", default="auto")
    args = p.parse_args(argv)
    from zserve.transport import die_with_parent

    die_with_parent(signal.SIGKILL)  # rank 0 gone: nothing to follow
    logging.basicConfig(level=logging.INFO, format=f"tp-rank-{args.rank} %(levelname)s %(message)s")
    follow(args.rank, GroupSpec(args.size, args.store, args.path, args.dtype, args.device, args.model_impl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
