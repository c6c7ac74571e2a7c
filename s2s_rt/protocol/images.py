"""``input_image`` content: a PNG or JPEG as a data URI, checked before it joins the conversation.

The server never fetches an image from a URL a client names (it would reach
any address for them): only ``data:image/png;base64,…`` and
``data:image/jpeg;base64,…`` are taken, as OpenAI's types describe them.
The image is read far enough to know it is one (Pillow reads its header and
checks its structure: chunk checksums for a PNG, markers for a JPEG), its
pixels are bounded (a small file can claim a huge picture), and its bytes
count in the session's conversation budget like any item's.
"""

from __future__ import annotations

import binascii
import io
import warnings

from PIL import Image

#: Largest image, decoded from base64, in bytes.
MAX_IMAGE_BYTES = 10 << 20
#: Largest image in pixels (width x height): 8192 x 4096.
MAX_IMAGE_PIXELS = 8192 * 4096
#: What a data URI may say its content is, and the format Pillow must find in it.
FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}
#: ``detail`` values OpenAI's types allow.
DETAILS = ("auto", "low", "high")


class ImageError(ValueError):
    """Why an ``image_url`` was refused, for the client."""


def check_image(url: object) -> str:
    """Check ``url`` as an ``input_image``'s ``image_url``; returns it.

    Raises:
        ImageError: not a PNG or JPEG data URI, not base64, too large, or not
            the image it says it is.
    """
    if not isinstance(url, str):
        raise ImageError("input_image needs 'image_url': a PNG or JPEG as a data URI (data:image/png;base64,...)")
    head, comma, data = url.partition(",")
    media, _, encoding = head.removeprefix("data:").partition(";")
    if not head.startswith("data:") or not comma:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ImageError(f"image_url must be a data URI (data:image/png;base64,...), never fetched: not {shown!r}")
    if media.lower() not in FORMATS or encoding.lower() != "base64":
        raise ImageError(f"image_url must hold a PNG or JPEG in base64 (image/png or image/jpeg), not {head!r}")
    if len(data) > (MAX_IMAGE_BYTES + 2) // 3 * 4:
        raise ImageError(f"The image holds more than {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        raw = binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError):
        raise ImageError("image_url's data is not valid base64") from None
    expected = FORMATS[media.lower()]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw), formats=[expected]) as image:
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise ImageError(f"The image is {width} x {height} pixels; at most {MAX_IMAGE_PIXELS} are taken")
                image.verify()
    except ImageError:
        raise
    except Exception as exc:  # Pillow says what is wrong in many ways (OSError, SyntaxError, struct.error...)
        raise ImageError(f"image_url's data is not a readable {expected} image: {exc}") from None
    return url
