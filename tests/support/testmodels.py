"""Models used by the tests. Importable by engine subprocesses: the fixtures put this folder on
PYTHONPATH."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from zserve import BadRequest, Model
from zserve.models.causal_lm import CausalLM


class SlowEcho(Model):
    """Echo that spends ``delay_s`` per batch (a stand-in for device time) and reports who served it."""

    def __init__(self, delay_s: float = 0.05) -> None:
        super().__init__(delay_s=delay_s)
        self.delay_s = float(delay_s)

    def predict(self, batch: list[Any]) -> list[Any]:
        time.sleep(self.delay_s)
        return [{"echo": item, "pid": os.getpid(), "batch": len(batch)} for item in batch]


class Picky(Model):
    """Fails in every way a model can, one item at a time.

    body {"reject": ...} -> decode_request raises BadRequest (field "reject");
    item "boom"          -> predict raises (only that item must fail);
    item "short"         -> predict returns one output too few (the whole batch fails);
    item "unencodable"   -> encode_response raises;
    anything else        -> {"ok": item}.
    """

    def decode_request(self, body: Any) -> Any:
        if isinstance(body, dict) and "reject" in body:
            raise BadRequest("reject is not allowed here", field="reject")
        return body

    def predict(self, batch: list[Any]) -> list[Any]:
        time.sleep(0.01)
        if "boom" in batch:
            raise ValueError("boom")
        outputs = [{"ok": item} for item in batch]
        return outputs[:-1] if "short" in batch else outputs

    def encode_response(self, output: Any) -> Any:
        if output == {"ok": "unencodable"}:
            raise RuntimeError("cannot encode this one")
        return output


class Hangs(SlowEcho):
    """SlowEcho whose ``predict`` never returns on a batch holding the item "hang" (its heartbeat thread
    lives on: only the broker's batch_timeout_s can tell)."""

    def predict(self, batch: list[Any]) -> list[Any]:
        if "hang" in batch:
            threading.Event().wait()
        return super().predict(batch)


class Broken(Model):
    """An engine that can never start: setup always fails."""

    def setup(self, device: str) -> None:
        raise RuntimeError("weights not found (on purpose)")

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch


class Recorder(SlowEcho):
    """SlowEcho that appends every item it computes to the file ``log_path``."""

    def __init__(self, delay_s: float = 0.05, log_path: str = "") -> None:
        super().__init__(delay_s)
        self.log_path = log_path

    def predict(self, batch: list[Any]) -> list[Any]:
        outputs = super().predict(batch)
        with open(self.log_path, "a") as f:
            f.writelines(f"{item}\n" for item in batch)
        return outputs


class Staged(Model):
    """A model with a preprocess stage. preprocess sleeps ``stage_delay_s`` per batch (2 s more if an item
    is "slow") and fails the whole batch if an item is "poison"; both halves report their pid."""

    def __init__(self, stage_delay_s: float = 0.0, engine_delay_s: float = 0.0) -> None:
        super().__init__(stage_delay_s=stage_delay_s, engine_delay_s=engine_delay_s)
        self.stage_delay_s = float(stage_delay_s)
        self.engine_delay_s = float(engine_delay_s)

    def setup_preprocess(self) -> None:
        self.stage_pid = os.getpid()

    def preprocess(self, items: list[Any]) -> Any:
        time.sleep(self.stage_delay_s + (2.0 if "slow" in items else 0.0))
        if "poison" in items:
            raise ValueError("cannot preprocess poison")
        return {"items": items, "stage_pid": self.stage_pid, "n": len(items)}

    def predict(self, batch: Any) -> list[Any]:
        time.sleep(self.engine_delay_s)
        return [
            {"echo": item, "stage_pid": batch["stage_pid"], "engine_pid": os.getpid(), "batch": batch["n"]}
            for item in batch["items"]
        ]


class MisplacedTokenizer(Model):
    """The mistake the start-up check catches: preprocess uses what only setup (engines) creates."""

    def setup(self, device: str) -> None:
        self.tokenizer = str.split

    def preprocess(self, items: list[Any]) -> Any:
        return [self.tokenizer(item) for item in items]

    def predict(self, batch: Any) -> list[Any]:
        return batch


class CostedEcho(SlowEcho):
    """SlowEcho batched by cost: an item's cost is its body's ``cost`` (default 1)."""

    def cost(self, item: Any) -> int:
        return int(item.get("cost", 1)) if isinstance(item, dict) else 1


class HangingLM(CausalLM):
    """The generative CausalLM whose engine step blocks forever once the file ``hang_file`` appears: the
    first engine to step after that takes the file (unlink is atomic, so exactly one hangs) and stops
    advancing while its heartbeat thread lives on, so only the broker's batch_timeout_s can tell. Each step
    takes at least ``step_s`` (a tiny model's 400 tokens would otherwise be over before a test can fault it)."""

    def __init__(self, hang_file: str = "", step_s: float = 0.0, **options: Any) -> None:
        super().__init__(**options)
        self.options["hang_file"] = hang_file
        self.hang_file = hang_file
        self.step_s = step_s

    def setup(self, device: str) -> None:
        super().setup(device)
        core, step = self.generator.core, self.generator.core.step

        def step_or_hang() -> Any:
            try:
                os.unlink(self.hang_file)
            except OSError:
                if self.step_s:
                    time.sleep(self.step_s)
                return step()
            threading.Event().wait()

        core.step = step_or_hang


class DictLM(CausalLM):
    """A generative model written to the contract before 2026-12-07: decode_request returns a GenerateRequest-shaped
    dict, not the struct (the frontends still hold it to [limits])."""

    def decode_request(self, body: Any) -> dict[str, Any]:
        import msgspec

        return msgspec.to_builtins(super().decode_request(body))
