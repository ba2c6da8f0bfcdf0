"""``zserve.models.image_classification:ImageClassification``: any ``AutoModelForImageClassification``
folder (ViT, ConvNeXt, ResNet, ...), with its own image processor.

The heterogeneous pipeline preprocess stages exist for: frontends only read each image's header (format and
size: a bad image is a 400 before it is queued, and its pixel count is its cost for ``max_batch_cost``);
decoding, RGB conversion and resizing (Pillow, through the folder's image processor) run on CPU stage
processes while the engines run the forward pass on the previous batch.

Options: ``path`` (a ``from_pretrained`` folder, required), ``top_k`` (labels per answer, default 5; 0 =
all), ``max_pixels`` (width x height; larger images are refused with a 400, default 40,000,000).

Request: the image file's bytes as the body (``Content-Type: image/*`` or ``application/octet-stream``, or
``bytes`` from the direct client), or JSON ``{"image": "<base64>"}`` (a ``data:image/...;base64,`` prefix is
accepted). Response: ``{"label": "tabby cat", "score": 0.91, "labels": [{"label", "score"}, ...]}``.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

import numpy as np

from zserve.errors import BadRequest
from zserve.model import Model
from zserve.models.classification import encode_ranked, ranked_labels
from zserve.models.st_library import HF_LOAD_KWARGS
from zserve.models.text import object_body, reject_unknown

DEFAULT_MAX_PIXELS = 40_000_000


def _image_bytes(body: Any) -> bytes:
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    body = object_body(body, '{"image": "<base64>"} (or the image file as the body)', "image")
    reject_unknown(body, ("image",))
    value = body.get("image")
    if not isinstance(value, str) or not value:
        raise BadRequest("`image` is required: the image file, base64-encoded", field="image")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("`image` is not valid base64", field="image") from None


class ImageClassification(Model):
    def __init__(self, path: str = "", top_k: int = 5, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        super().__init__(path=path, top_k=top_k, max_pixels=max_pixels)
        if not path:
            raise ValueError("ImageClassification needs [models.options] path (a from_pretrained folder)")
        if int(top_k) < 0 or int(max_pixels) < 1:
            raise ValueError("top_k must be 0 (all labels) or more, and max_pixels at least 1")
        self.path = path
        self.top_k = int(top_k)
        self.max_pixels = int(max_pixels)

    # ---- frontends ----

    def decode_request(self, body: Any) -> list[Any]:
        """[the file's bytes, its pixel count]: the header is read (not the pixels) so that a file that is
        not an image is refused here, by name."""
        from PIL import Image, UnidentifiedImageError

        data = _image_bytes(body)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as image:
                    width, height = image.size
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombWarning,
                Image.DecompressionBombError) as exc:  # fmt: skip
            raise BadRequest(f"`image` is not an image Pillow can read: {exc}", field="image") from None
        if width * height > self.max_pixels:
            raise BadRequest(f"`image` is {width}x{height}, over max_pixels {self.max_pixels}", field="image")
        return [data, width * height]

    def cost(self, item: list[Any]) -> int:
        return int(item[1])

    # ---- preprocess stage ----

    def setup_preprocess(self) -> None:
        # From its module: transformers 5.17's top-level AutoImageProcessor is a stand-in that demands torchvision,
        # though the class itself falls back to the PIL processors without it (as the top-level one does from 5.18).
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(self.path)

    def preprocess(self, items: list[list[Any]]) -> dict[str, np.ndarray]:
        """Decode every image in full and let the model's processor resize and normalise them. An image
        whose pixels do not decode (a truncated file) is marked in ``ok`` and answered 400 by ``predict``;
        its batch-mates are not affected."""
        from PIL import Image

        images, ok = [], np.zeros(len(items), dtype=bool)
        for i, (data, _pixels) in enumerate(items):
            try:
                with Image.open(io.BytesIO(data)) as image:
                    # Full-scale decoding, as transformers' pipeline does: JPEG draft mode would be faster
                    # on large photos but changes the pixels the processor resizes, hence the scores.
                    images.append(image.convert("RGB"))
                ok[i] = True
            except (OSError, ValueError, SyntaxError):
                pass
        if images:
            pixels = np.asarray(self.processor(images=images, return_tensors="np")["pixel_values"], dtype=np.float32)
        else:
            pixels = np.zeros((0, 0), dtype=np.float32)
        return {"pixel_values": pixels, "ok": ok}

    # ---- engine ----

    def setup(self, device: str) -> None:
        import torch
        from transformers import AutoModelForImageClassification
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.torch = torch
        self.device = torch.device(device)
        self.model = AutoModelForImageClassification.from_pretrained(self.path, **HF_LOAD_KWARGS).to(self.device).eval()
        config = self.model.config
        self.labels = [config.id2label.get(i, f"LABEL_{i}") for i in range(config.num_labels)]

    def warmup(self) -> None:
        size = getattr(self.model.config, "image_size", 224)
        side = size if isinstance(size, int) else max(size)
        channels = getattr(self.model.config, "num_channels", 3)
        self.predict({"pixel_values": np.zeros((1, channels, side, side), np.float32), "ok": np.ones(1, bool)})

    def predict(self, batch: dict[str, np.ndarray]) -> list[Any]:
        ok = np.asarray(batch["ok"], dtype=bool)
        outputs: list[Any] = [
            BadRequest("`image` could not be decoded (a truncated or corrupt file)", field="image") for _ in ok
        ]
        if ok.any():
            torch = self.torch
            pixels = torch.from_numpy(np.array(batch["pixel_values"], dtype=np.float32)).to(self.device)
            with torch.inference_mode():
                scores = self.model(pixel_values=pixels).logits.float().softmax(dim=-1)
            for i, ranked in zip(np.flatnonzero(ok), ranked_labels(scores, self.labels, self.top_k), strict=True):
                outputs[i] = ranked
        return outputs

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return encode_ranked(output)
