"""``backend = "onnx"`` / ``"onnx-int8"`` for embedding models: the stack's Transformer runs in ONNX Runtime, the
library's other modules (Pooling, Dense, Normalize) in torch, on the engine's threads.

sentence-transformers' own ONNX backend needs optimum-onnx, whose releases require transformers < 5, so the
encoder is exported here with torch's exporter, once per model into zserve's cache (``<cache>/onnx/``, keyed by the
weights' sha256, the torch version and the variant) and reused by every later start. The export is written to a
temporary file and renamed into place, so engines starting together may both export but never read half a file.
``onnx-int8`` is ONNX Runtime's dynamic int8 quantisation of that export (int8 weights per channel): measured 2.5x
to 4x fp32 on one thread, but lossy (cosine ~0.975 to fp32 on all-MiniLM-L6-v2), so never a default.

Measured on this project's 2-core CPU, all-MiniLM-L6-v2, 1 thread (bench/embeddings/backends.py): fp32 ONNX Runtime
1.2 to 1.4x torch on batches of 32 short sentences and 1.9x on single sentences, with the same vectors (cosine 1.0).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from zserve.errors import ModelLoadError
from zserve.gguf_cache import file_sha256, zserve_cache

log = logging.getLogger("zserve.onnx")

BACKENDS = ("auto", "torch", "onnx", "onnx-int8")  # auto: zserve.models.backend_choice
_OPSET = 17
_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    return backend


def _weights_key(folder: Path, variant: str) -> str:
    import torch

    digest = hashlib.sha256(f"{variant}|opset{_OPSET}|torch{torch.__version__}".encode())
    weights = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    if not weights:
        raise ModelLoadError(f"{folder}: no weights file (*.safetensors, *.bin) to export to ONNX")
    for path in weights:
        digest.update(f"{path.name}:{file_sha256(path)}".encode())
    return digest.hexdigest()[:20]


def exported(transformer: Any, folder: Path, variant: str) -> Path:
    """The ONNX file of ``transformer`` (the stack's first module, loaded from ``folder``) in ``variant``
    (``onnx`` or ``onnx-int8``), exported into the cache on first use."""
    target = zserve_cache() / "onnx" / f"{folder.name}-{_weights_key(folder, variant)}" / "model.onnx"
    if target.is_file():
        log.info("using the ONNX export %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="model.onnx.tmp-", dir=target.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the cache from anyone else the cache is shared with
    try:
        log.info("exporting %s to ONNX (%s) in %s, once", folder, variant, target.parent)
        _export(transformer, Path(tmp))
        if variant == "onnx-int8":
            _quantize(Path(tmp))
        os.replace(tmp, target)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{folder}: cannot export the encoder to ONNX ({type(exc).__name__}: {exc}); "
                             'serve it with backend = "torch"') from exc  # fmt: skip
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _export(transformer: Any, path: Path) -> None:
    import torch

    # A copy: tracing leaves the traced module computing other numbers afterwards (0.08 off the library's vectors
    # on MiniLM under transformers 5.24), and backend = "auto" goes on to run the original with torch.
    model = copy.deepcopy(transformer.auto_model).float().eval()
    names = [name for name in _INPUTS if name in transformer.tokenizer.model_input_names or name != "token_type_ids"]

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs: Any) -> Any:
            return self.model(**dict(zip(names, inputs, strict=True)), return_dict=True).last_hidden_state

    # A padded batch of two: a batch of one would be traced as a constant dimension.
    example = transformer.tokenizer(["an example", "a longer example sentence"], padding=True, return_tensors="pt")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings on transformers' mask code: parity is tested
        torch.onnx.export(
            Encoder(), tuple(example[name] for name in names), str(path), input_names=names,
            output_names=["last_hidden_state"], opset_version=_OPSET, do_constant_folding=True, dynamo=False,
            dynamic_axes={name: {0: "batch", 1: "sequence"} for name in [*names, "last_hidden_state"]},
        )  # fmt: skip


def _quantize(path: Path) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantized = path.with_suffix(".int8")
    quantize_dynamic(str(path), str(quantized), weight_type=QuantType.QInt8, per_channel=True,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})  # fmt: skip
    os.replace(quantized, path)


class OnnxStack:
    """Runs a SentenceTransformer with its first module in ONNX Runtime: ``__call__(features)`` returns the
    library's features dict, as ``model(features)`` would."""

    def __init__(self, model: Any, folder: Path, variant: str, threads: int) -> None:
        import onnxruntime as ort

        self.model = model
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        path = exported(model[0], folder, variant)
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]
        self.rest = list(model)[1:]

    def __call__(self, features: dict[str, Any]) -> dict[str, Any]:
        import torch

        inputs = {name: np.asarray(features[name], dtype=np.int64) for name in self.names}
        [hidden] = self.session.run(["last_hidden_state"], inputs)
        out: dict[str, Any] = {k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v
                               for k, v in features.items()}  # fmt: skip
        out["token_embeddings"] = torch.from_numpy(hidden)
        with torch.inference_mode():
            for module in self.rest:
                out = module(out)
        return out
