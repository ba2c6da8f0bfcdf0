"""Start infinity-emb's CLI (``infinity_emb v2 ...``) with its compute held to BENCH_THREADS threads.

Run with the infinity virtualenv's Python (``.venv-infinity/bin/python bench/embeddings/infinity_launch.py v2
--model-id DIR ...``). infinity has no thread option of its own: its torch engine follows OMP_NUM_THREADS (set by
run.py too) and this also calls ``torch.set_num_threads``; its optimum engine builds onnxruntime sessions with
onnxruntime's default (one thread per physical core), so every ``InferenceSession`` made here gets
``intra_op_num_threads = BENCH_THREADS`` and ``inter_op_num_threads = 1``.

One compatibility shim, for the optimum engine only: infinity 0.0.78 hands optimum the ONNX file as a path
(``onnx/model.onnx``, absolute for a local folder) in ``file_name``, and optimum 2.x (the only optimum that
installs next to torch 2.13: optimum 1.x's ONNX exporter imports a torch.onnx function torch 2.13 no longer has)
matches ``file_name`` against file *names*, so no file matches and the engine does not start ("Could not find any
ONNX files with target file name ..."). For a local file the shim loads it by name from its own folder (run.py puts
a config.json next to it); the file loaded is the same. Nothing else of infinity is changed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def hold_threads(threads: int) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:
        pass
    try:
        import onnxruntime
    except ImportError:
        return
    original = onnxruntime.InferenceSession.__init__

    def init(self: Any, path_or_bytes: Any, sess_options: Any = None, *args: Any, **kwargs: Any) -> None:
        options = sess_options if sess_options is not None else onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        original(self, path_or_bytes, options, *args, **kwargs)

    onnxruntime.InferenceSession.__init__ = init


def optimum_file_name_shim() -> None:
    try:
        from infinity_emb.transformer import utils_optimum
        from infinity_emb.transformer.embedder import optimum as optimum_embedder
    except ImportError:
        return
    original = utils_optimum.optimize_model

    def optimize_model(**kwargs: Any) -> Any:
        path = Path(kwargs["file_name"])
        if not path.is_file():  # relative to the model folder (a glob of a relative folder gives it whole)
            path = Path(kwargs["model_name_or_path"]) / path
        if path.is_file():  # a local file: load it from its own folder, by name (that folder holds a config.json)
            kwargs.update(model_name_or_path=str(path.parent), file_name=path.name)
        return original(**kwargs)

    utils_optimum.optimize_model = optimize_model
    optimum_embedder.optimize_model = optimize_model  # imported by name there


def main() -> None:
    hold_threads(int(os.environ.get("BENCH_THREADS", "1")))
    optimum_file_name_shim()
    from infinity_emb.cli import cli

    sys.argv = ["infinity_emb", *sys.argv[1:]]
    sys.exit(cli())


if __name__ == "__main__":
    main()
