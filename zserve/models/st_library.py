"""The sentence-transformers library, split the zserve way, for ``SentenceEmbedding`` and ``CrossEncoderRerank``.

A folder's whole module stack (Transformer, Pooling in any mode, Dense, Normalize, a cross-encoder's head and
activation; prompts, ``max_seq_length``, ``truncate_dim``) is computed by the library itself. The stage process
loads the same library object with its weights on the ``meta`` device (config and processor only, nothing in
memory) and runs the library's ``preprocess`` (tokenising, with the prompt); the engine loads it with weights and
runs its ``forward``. Nothing is hand-written that the library already does.

Per request a text may name a prompt; the library's ``preprocess`` takes one prompt per call and Pooling reads one
``prompt_length`` per batch, so a batch is tokenised in one *group* per distinct prompt and each group is one
forward (one group in the common case).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from zserve.errors import ModelLoadError
from zserve.generator.options import DTYPES, resolve_dtype

# Keyword arguments for every transformers ``from_pretrained`` of a batch model. transformers 5.25 turned the
# ``kernels`` package's hub kernels on by default (``use_kernels=None`` became True; 5.17 to 5.24 default to False):
# every load then kernelizes the model for its device, which on the stage's weightless copy raises "ValueError:
# Unsupported device type 'meta'", and on an engine would swap layers for code fetched from the Hub at start. False,
# which every 5.x accepts, keeps what 5.24 did: the library's own modules, the parity tests' reference.
HF_LOAD_KWARGS: dict[str, Any] = {"use_kernels": False}


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return dtype


def torch_dtype(dtype: str, device: Any) -> Any:
    """The torch dtype for a handler's ``dtype`` option on ``device``: ``resolve_dtype``'s, the rule of every
    model kind (``auto``: bfloat16 on a CUDA device that supports it, float32 elsewhere)."""
    import torch

    return getattr(torch, resolve_dtype(device, dtype))


def load(cls: type, folder: str, device: str | None, **kwargs: Any) -> Any:
    """``cls(folder)`` (SentenceTransformer or CrossEncoder) on ``device``; ``device=None`` is the stage's copy:
    weights on the ``meta`` device. A folder the library cannot load raises ModelLoadError naming it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one log line per event, not a progress bar per load
    try:
        if device is None:
            return cls(folder, model_kwargs={"device_map": "meta", **HF_LOAD_KWARGS}, **kwargs)
        return cls(folder, device=device, model_kwargs=dict(HF_LOAD_KWARGS), **kwargs)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise ModelLoadError(f"{folder}: sentence-transformers cannot load this folder: {why}") from exc


def stage_copy(cls: type, folder: str, max_length: int) -> Any:
    """The stage's copy of ``cls(folder)`` (weights on ``meta``), truncating at ``max_length`` tokens where that is
    below the model's own limit (0: the model's)."""
    model = load(cls, folder, None)
    if max_length:
        model.max_seq_length = min(max_length, model.max_seq_length or max_length)
    return model


def group_rows(keys: list[Any]) -> list[list[int]]:
    """Row indices grouped by key, groups in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for row, key in enumerate(keys):
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def arrays(features: dict[str, Any]) -> dict[str, Any]:
    """The library's features as a payload: tensors become numpy arrays (raw frames), other values stay."""
    return {k: v.numpy() if hasattr(v, "numpy") else v for k, v in features.items()}


def padded_ids(rows: list[list[int]], tokenizer: Any, token_type_ids: bool) -> dict[str, np.ndarray]:
    """Token-id inputs as the tokenizer would pad them (its pad id and padding side)."""
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), tokenizer.pad_token_id or 0, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if tokenizer.padding_side == "left" else slice(0, len(row))
        ids[i, span] = row
        mask[i, span] = 1
    out = {"input_ids": ids, "attention_mask": mask, "modality": "text"}
    if token_type_ids:
        out["token_type_ids"] = np.zeros_like(ids)
    return out


class Forward:
    """The engine's side: a loaded library model and its device, running one group's features at a time."""

    def __init__(self, model: Any, device: str, dtype: str, backend: str = "torch", folder: str = "") -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.model = model.to(torch_dtype(dtype, self.device)).eval()
        self.pinned = self.device.type == "cuda"
        self.onnx = None
        self.threads = int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
        if backend == "auto":
            self.onnx = self._auto(folder)
        elif backend != "torch":
            if self.device.type != "cpu" or self.model.dtype != torch.float32:
                raise ModelLoadError(f'{folder}: backend = "{backend}" runs in float32 on the CPU; use "torch" on '
                                     f"{device} or with dtype {dtype}")  # fmt: skip
            from zserve.models.onnx_encoder import OnnxStack

            self.onnx = OnnxStack(self.model, Path(folder), backend, self.threads)

    def _auto(self, folder: str) -> Any:
        """``backend = "auto"``: an OnnxStack where ONNX Runtime measured faster with the same vectors, else None
        (torch); the choice logged in one line."""
        from zserve.models import backend_choice

        stack, why_not = None, ""
        if self.device.type != "cpu" or self.model.dtype != self.torch.float32:
            why_not = f"it runs float32 on the CPU, this engine {self.model.dtype} on {self.device}"
        else:
            try:
                from zserve.models.onnx_encoder import OnnxStack

                stack = OnnxStack(self.model, Path(folder), "onnx", self.threads)
            except ImportError:
                why_not = "not installed: pip install 'zserve[onnx]'"
            except Exception as exc:  # an encoder the exporter cannot take serves with torch, as it did before
                why_not = f"{type(exc).__name__}: {exc}"
        measured = None
        if stack is not None:
            try:
                measured = backend_choice.measure(self.model, self._torch, stack)
            except Exception as exc:  # ONNX Runtime failing on a probe (a broken cached export, say): torch serves
                why_not = f"failed on a probe: {type(exc).__name__}: {exc}"
        if measured is None:
            stack = None
            choice, reason = backend_choice.choose([], None, why_not)
        else:
            choice, reason = backend_choice.choose(*measured)
        backend_choice.log.info("%s: backend auto -> %s: %s", folder or "the model", choice, reason)
        return stack if choice == "onnx" else None

    def __call__(self, features: dict[str, Any]) -> dict[str, Any]:
        """The library's forward on one group (arrays decoded from frames); outputs stay on the device."""
        if self.onnx is not None:
            return self.onnx(features)
        return self._torch(features)

    def _torch(self, features: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        inputs: dict[str, Any] = {}
        for key, value in features.items():
            if isinstance(value, np.ndarray):
                # np.array copies: arrays decoded from frames are read-only views, which torch will not wrap.
                tensor = torch.from_numpy(np.array(value))
                if self.pinned:  # to the device from pinned memory, without blocking the host
                    tensor = tensor.pin_memory().to(self.device, non_blocking=True)
                else:
                    tensor = tensor.to(self.device)
                inputs[key] = tensor
            else:
                inputs[key] = value
        with torch.inference_mode():
            return self.model(inputs)

    def rows_to_host(self, groups: list[list[int]], outputs: list[Any], n: int, post: Callable[[Any], Any]) -> Any:
        """The groups' outputs (one tensor per group, rows in the group's order) back in batch order, as float32
        on the host in one copy; ``post`` runs on the device first (the library's activation, say)."""
        torch = self.torch
        order = torch.tensor([row for rows in groups for row in rows], device=self.device)
        stacked = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        result = stacked.new_zeros((n, *stacked.shape[1:]))  # rows that failed their checks stay zero
        result[order] = stacked
        return post(result.float()).cpu().numpy()
