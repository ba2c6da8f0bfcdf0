"""The two baselines of the generation benchmark, both Hugging Face ``model.generate`` in this process
(greedy, ``min_new_tokens = max_new_tokens`` so that nothing stops early):

* static batching: requests that arrive within ``window_s`` of the first one (up to ``max_batch``) are
  left-padded and generated together for as many steps as the longest of them asks for;
* single: one request at a time, in arrival order.

Every decoding step is timestamped by a streamer (``generate`` hands it each step's tokens, moved to the
CPU, so the time is taken once the step is done, on a GPU too). A request's first token is the end of its
group's first step, its last token the end of the step that produced its own last one.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import statistics
import threading
import time
from typing import Any

from bench.generation.workload import GenRequest, Timing


class StepClock:
    """A ``generate`` streamer that only notes when each step ended (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.steps_s: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.steps_s.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class HFGenerator:
    """The model and how to run a left-padded group through ``model.generate``."""

    def __init__(self, model: Any, tokenizer: Any, device: str) -> None:
        import torch

        self.torch = torch
        self.model = model.eval()
        self.device = device
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        """Generate ``new_tokens`` for every prompt together; returns when each step ended."""
        from transformers import GenerationConfig

        torch = self.torch
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, longest - len(p) :] = torch.tensor(p)
            mask[row, longest - len(p) :] = 1
        config = GenerationConfig(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1,
            pad_token_id=self.pad_id, eos_token_id=self.eos_id,
        )  # fmt: skip
        clock = StepClock()
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config,
                streamer=clock,
            )  # fmt: skip
        if len(clock.steps_s) != new_tokens:
            raise RuntimeError(f"model.generate made {len(clock.steps_s)} steps, {new_tokens} were asked for")
        return clock.steps_s

    def warm_up(self) -> None:
        self.generate([[self.pad_id] * 8, [self.pad_id] * 4], 4)


class StaticBatcher:
    """Groups the callers' requests in a window after the first arrival and runs each group through
    ``model.generate`` in one background thread."""

    def __init__(self, gen: HFGenerator, max_batch: int, window_s: float) -> None:
        self.gen = gen
        self.max_batch = max_batch
        self.window_s = window_s
        self.groups: list[int] = []  # sizes of the groups run, for the report
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="static-batcher", daemon=True)
        self._thread.start()

    def __call__(self, request: GenRequest, deadline: float | None) -> Timing | None:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((time.perf_counter(), request, deadline, future))
        return future.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            group = [first]
            window_ends = first[0] + self.window_s
            while len(group) < self.max_batch:
                try:
                    item = self._queue.get(timeout=max(0.0, window_ends - time.perf_counter()))
                except queue.Empty:
                    break
                if item is None:  # closing: finish this group first
                    self._queue.put(None)
                    break
                group.append(item)
            self._run_group(group)

    def _run_group(self, group: list[tuple[float, GenRequest, float | None, concurrent.futures.Future]]) -> None:
        deadline = group[0][2]
        if deadline is not None and time.perf_counter() >= deadline:  # --duration-s is over: not started
            for *_, future in group:
                future.set_result(None)
            return
        self.groups.append(len(group))
        try:
            steps = self.gen.generate([r.prompt_ids for _, r, _, _ in group], max(r.output_len for _, r, _, _ in group))
        except BaseException as exc:
            for *_, future in group:
                future.set_exception(exc)
            return
        for start, request, _, future in group:
            future.set_result(Timing(start, steps[0], steps[request.output_len - 1], request.output_len))


def one_at_a_time(gen: HFGenerator) -> StaticBatcher:
    """``model.generate`` on one request at a time, first come first served (a queue in front of the model
    rather than a bare lock, which lets the caller that just released it take it again at once)."""
    return StaticBatcher(gen, max_batch=1, window_s=0.0)


def calibrate(gen: HFGenerator, batch: int, prompt_len: int = 128, steps: int = 6) -> dict[str, float]:
    """Rough speeds for the run-time estimate: prefill tokens/s at batch 1, the median decode step time at
    batch 1 and at ``batch`` (short prompts)."""
    gen.warm_up()  # the first calls are slow
    prompt = [gen.pad_id] * prompt_len
    gen.generate([prompt], 1)
    t0 = time.perf_counter()
    gen.generate([prompt], 1)
    prefill_s = time.perf_counter() - t0

    def step_s(b: int) -> float:
        gen.generate([[gen.pad_id] * 8] * b, 2)  # a new batch size is slow the first time (kernel choice)
        ended = gen.generate([[gen.pad_id] * 8] * b, steps)
        return statistics.median(later - earlier for earlier, later in itertools.pairwise(ended))

    return {"prefill_tok_s": prompt_len / prefill_s, "step_s_b1": step_s(1), "step_s_bmax": step_s(batch),
            "bmax": batch}  # fmt: skip


def hf_uniform(gen: HFGenerator, requests: list[GenRequest]) -> dict[str, float]:
    """``model.generate`` on the whole uniform batch at once: output tokens/s, prefill included."""
    new_tokens = requests[0].output_len
    gen.generate([r.prompt_ids for r in requests[:2]], 2)  # warm-up at this prompt length
    t0 = time.perf_counter()
    steps = gen.generate([r.prompt_ids for r in requests], new_tokens)
    wall_s = steps[-1] - t0
    return {"tok_s": len(requests) * new_tokens / wall_s, "wall_s": wall_s, "first_step_s": steps[0] - t0}
