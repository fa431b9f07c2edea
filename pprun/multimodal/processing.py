"""Turning a prompt's images into multimodal items: loading, the checkpoint's own image processor,
placeholder expansion, content hashes, and the checks that come before any work starts.

A prompt names each image with one image token (``<image>``, the config's ``image_token_index``);
:meth:`ImageProcessor.process` expands the i-th such token into the i-th image's placeholder
range: ``num_embeds`` image tokens for CLIP/SigLIP towers, and for Pixtral one row of image
tokens per patch row, each row closed by ``[IMG_BREAK]`` and the last by ``[IMG_END]`` (those
text tokens stay inside the range with ``is_embed`` False).  Pixels come from ``transformers``'
PIL image processors, configured by the checkpoint's ``preprocessor_config.json``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pprun.multimodal.items import MultiModalItem, PlaceholderRange

SUPPORTED_MODALITIES: tuple[str, ...] = ("image",)
"""``multi_modal_data`` keys a vision-language model takes."""


def load_image(image: object, where: str):
    """A PIL RGB image from a PIL image, a NumPy array (``HxW`` or ``HxWxC``, C in 1/3/4, uint8)
    or a file path (str or Path; also a ``data:image/...;base64,`` URL).  Raises ValueError
    naming ``where`` for anything else, an unreadable file or an image of zero size."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        img = image
    elif isinstance(image, np.ndarray):
        arr = image
        if arr.ndim == 3 and arr.shape[-1] == 1:
            arr = arr[..., 0]
        if arr.dtype != np.uint8 or not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[-1] in (3, 4))):
            raise ValueError(
                f"{where} is a NumPy array of shape {arr.shape} and dtype {arr.dtype}: an image array must be "
                "uint8 of shape HxW or HxWxC with C in 1, 3 or 4"
            )
        if arr.size == 0:
            raise ValueError(f"{where} is an image of zero size (shape {arr.shape})")
        img = Image.fromarray(arr)
    elif isinstance(image, (str, Path)):
        text = str(image)
        try:
            if text.startswith("data:"):
                header, _, payload = text.partition(",")
                if not header.startswith("data:image/") or ";base64" not in header:
                    raise ValueError(f"{where}: a data URL must be data:image/<type>;base64,<data>, got {header[:40]!r}")
                img = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
            else:
                if not Path(text).is_file():
                    raise ValueError(f"{where}={text!r} is not a file")
                img = Image.open(text)
            img.load()
        except (UnidentifiedImageError, OSError, ValueError, base64.binascii.Error) as e:
            if isinstance(e, ValueError) and str(e).startswith(where):
                raise
            shown = text if len(text) <= 60 else text[:57] + "..."
            # PIL names the file object it read, which says nothing to the caller.
            reason = "not an image format PIL reads" if isinstance(e, UnidentifiedImageError) else str(e)
            raise ValueError(f"{where}={shown!r} is not a readable image: {reason}") from None
    else:
        raise ValueError(
            f"{where} has type {type(image).__name__}: an image must be a PIL image, a NumPy array or a file path"
        )
    if img.width == 0 or img.height == 0:
        raise ValueError(f"{where} is an image of zero size ({img.width}x{img.height})")
    return img.convert("RGB")


def _image_processor(model_dir: Path):
    """The checkpoint's image processor (its PIL class: pprun never needs torchvision)."""
    import transformers

    path = Path(model_dir) / "preprocessor_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
    else:
        # transformers 5 saves a processor's parts in one file, the image processor's under its key.
        path = Path(model_dir) / "processor_config.json"
        config = json.loads(path.read_text()).get("image_processor") if path.is_file() else None
        if not isinstance(config, dict):
            raise ValueError(
                f"model {str(model_dir)!r} has no image processor config (preprocessor_config.json, or "
                "processor_config.json with an 'image_processor' entry): it cannot process images"
            )
    name = config.get("image_processor_type", "")
    name = name.removesuffix("Fast")
    cls = getattr(transformers, f"{name}Pil", None) or getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"{path}: image_processor_type={name!r} is not a transformers image processor")
    return cls.from_pretrained(str(model_dir), local_files_only=True)


class ImageProcessor:
    """Images of a Llava-form model's prompts to items (see the module docstring)."""

    def __init__(self, model_dir: Path, multimodal: dict[str, Any], tokenizer: Any) -> None:
        self.model_dir = Path(model_dir)
        self.mm = multimodal
        self.image_token = int(multimodal["image_token_index"])
        vcfg = multimodal["vision_config"]
        self.tower_type = vcfg["model_type"]
        self.patch_size = int(vcfg["patch_size"])
        self.break_token = self.end_token = None
        if self.tower_type == "pixtral":
            ids = {}
            for name in ("[IMG_BREAK]", "[IMG_END]"):
                tid = tokenizer.convert_tokens_to_ids(name) if tokenizer is not None else None
                if tid is None or tid == getattr(tokenizer, "unk_token_id", None):
                    raise ValueError(f"model {str(model_dir)!r}: a Pixtral-form model needs a tokenizer with {name}")
                ids[name] = int(tid)
            self.break_token, self.end_token = ids["[IMG_BREAK]"], ids["[IMG_END]"]
        else:
            num_patches = (int(vcfg["image_size"]) // self.patch_size) ** 2
            num_patches += self.tower_type == "clip_vision_model"  # the class token
            num_patches -= multimodal["vision_feature_select_strategy"] == "default"  # ... dropped
            self.num_embeds = num_patches
        self._processor = None

    @property
    def processor(self):
        """The ``transformers`` image processor (loaded on first use)."""
        if self._processor is None:
            self._processor = _image_processor(self.model_dir)
        return self._processor

    def _pixels(self, image, where: str) -> tuple[dict[str, torch.Tensor], list[int]]:
        """One image's processed tensors and its placeholder tokens."""
        # PixtralProcessor resizes to whole patches of its own patch size (the tower's, in any
        # checkpoint whose placeholders match the tower's rows), not the image processor config's.
        sizing = {}
        if self.tower_type == "pixtral":
            sizing["patch_size"] = {"height": self.patch_size, "width": self.patch_size}
        out = self.processor([image], return_tensors="pt", **sizing)
        pixels = out["pixel_values"][0].to(torch.float32)
        if self.tower_type != "pixtral":
            return {"pixel_values": pixels}, [self.image_token] * self.num_embeds
        h, w = (int(v) for v in out["image_sizes"][0])
        pixels = pixels[:, :h, :w].contiguous()
        rows, cols = h // self.patch_size, w // self.patch_size
        if rows == 0 or cols == 0:
            raise ValueError(f"{where} is too small: {h}x{w} pixels after processing, under one {self.patch_size}-pixel patch")
        tokens = ([self.image_token] * cols + [self.break_token]) * rows
        tokens[-1] = self.end_token
        return {"pixel_values": pixels, "image_sizes": torch.tensor([h, w])}, tokens

    def process(self, token_ids: list[int], images: Sequence[object], where: str) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the prompt's image tokens (one per image, in order) and build the items.

        Raises ValueError naming ``where`` when the counts differ or an image cannot be read.
        """
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token]
        if len(positions) != len(images):
            raise ValueError(
                f"{where}.multi_modal_data['image'] has {len(images)} image(s) but the prompt has "
                f"{len(positions)} image token(s) (id {self.image_token}): give one image per image token"
            )
        expanded: list[int] = []
        items: list[MultiModalItem] = []
        prev = 0
        for index, (pos, image) in enumerate(zip(positions, images)):
            img = load_image(image, f"{where}.multi_modal_data['image'][{index}]")
            data, tokens = self._pixels(img, f"{where}.multi_modal_data['image'][{index}]")
            expanded.extend(token_ids[prev:pos])
            is_embed = None
            if self.tower_type == "pixtral":
                is_embed = tuple(t == self.image_token for t in tokens)
            items.append(MultiModalItem("image", content_hash(data), PlaceholderRange(len(expanded), len(tokens), is_embed), data))
            expanded.extend(tokens)
            prev = pos + 1
        expanded.extend(token_ids[prev:])
        return expanded, items


def content_hash(data: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the processed tensors (names, shapes, bytes): equal images share one entry."""
    h = hashlib.sha256()
    for name in sorted(data):
        t = data[name].contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def image_token_text(tokenizer: Any, image_token: int) -> str | None:
    """The text that tokenizes to the image token (``<image>``, ``[IMG]``), if the tokenizer has one."""
    if tokenizer is None:
        return None
    text = tokenizer.convert_ids_to_tokens(image_token)
    return text if isinstance(text, str) else None


def split_chat_images(conversation: list[dict], image_text: str | None, where: str) -> tuple[list[dict], list[object]]:
    """OpenAI-style content parts to plain text content: each ``{"type": "image_url", "image_url":
    {"url": ...}}`` part (a local path, ``file://`` URL or ``data:image/...;base64,`` URL) becomes
    the image token's text, and the images are returned in order.  Raises ValueError naming
    ``where`` for an unknown part type or a remote URL."""
    images: list[object] = []
    out = []
    for m_index, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        pieces = []
        for p_index, part in enumerate(content):
            at = f"{where}[{m_index}].content[{p_index}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                pieces.append(str(part.get("text", "")))
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"{at}.image_url must be {{'url': <path or data URL>}}, got {url!r}")
                if url.startswith(("http://", "https://")):
                    raise ValueError(f"{at}.image_url={url[:60]!r}: remote URLs are not fetched; give a local path or a data URL")
                if image_text is None:
                    raise ValueError(f"{at}: this model's tokenizer has no image token, so it takes no images")
                images.append(url.removeprefix("file://"))
                pieces.append(image_text)
            else:
                raise ValueError(f"{at} has type {kind!r}: a content part must be 'text' or 'image_url'")
        out.append({**message, "content": "".join(pieces)})
    return out, images
