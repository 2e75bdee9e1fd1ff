"""The storage URI grammar: one definition for storage, the operator's spec check and the CRD.

A storage root is ``s3://BUCKET[/PREFIX]``, ``gs://BUCKET[/PREFIX]`` or
``file:///PATH``. :data:`STORAGE_URI_PATTERN` is the whole grammar, written
as one regular expression in the subset that Python's ``re`` and Go's RE2
(the apiserver's OpenAPI ``pattern``) read alike: no look-around, and
:func:`parse_storage_uri` matches it whole (``fullmatch``; Go's ``$`` never
matches before a final newline, Python's does). The CRD's
``spec.checkpoint.storage`` carries this very pattern (and
:data:`MAX_URI_LENGTH` as its ``maxLength``); a table test checks Python, the
CRD and a real apiserver against each other.

- **Buckets.** ``gs://``: Google Cloud Storage's rules, lowercase letters,
  digits, ``-``, ``_`` and ``.``, starting and ending with a letter or digit,
  no ``..``. ``s3://``: also uppercase letters and ``_``, and up to 255
  characters: AWS's rules today (3-63 lowercase letters, digits, ``.``, ``-``)
  are stricter, but buckets made in us-east-1 before March 2018 may have such
  names and stay reachable (path-style), as may buckets of S3-compatible
  stores with relaxed names; refusing them would leave their owners no way
  to use spotguard, while a name the store does not know is refused by the
  store on first use with its own clear error. Lengths are bounded but, for
  names with dots, not to the exact character (a pattern cannot count and
  forbid ``..`` at once without look-around); the store refuses the rest.
- **Prefixes** are object keys, which nobody resolves: no ``.`` or ``..``
  segment, no empty segment between two others (slashes at either end do
  not count), no control characters.
- **file://** takes an absolute path without a host (``file:///PATH``),
  without control characters; ``..`` there is the file system's own.

Pure, standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Longest storage URI (an S3 or GCS object key is at most 1024 bytes, and checkpoints live under the root).
MAX_URI_LENGTH = 1024

_CHAR = r"[^/\x00-\x1f\x7f]"  # one character of a prefix segment
_NON_DOT = r"[^/.\x00-\x1f\x7f]"
# A segment that is neither "." nor "..".
_SEGMENT = rf"({_NON_DOT}{_CHAR}*|\.{_NON_DOT}{_CHAR}*|\.\.{_CHAR}+)"
_PREFIX = rf"(/+({_SEGMENT}(/{_SEGMENT})*/*)?)?"
S3_BUCKET_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]"
# First and last a letter or digit; between them anything of [a-z0-9._-] without "..".
GS_BUCKET_PATTERN = r"[a-z0-9](\.|\.?([a-z0-9_-]\.?){1,220})[a-z0-9]"
_FILE = r"file:///[^\x00-\x1f\x7f]*"

#: The whole grammar (also the CRD's ``pattern``, character for character).
STORAGE_URI_PATTERN = rf"^((s3://{S3_BUCKET_PATTERN}|gs://{GS_BUCKET_PATTERN}){_PREFIX}|{_FILE})$"

_URI_RE = re.compile(STORAGE_URI_PATTERN)
_BUCKET_RE = {"s3": re.compile(S3_BUCKET_PATTERN), "gs": re.compile(GS_BUCKET_PATTERN)}
_USE = "s3://BUCKET[/PREFIX], gs://BUCKET[/PREFIX] or file:///PATH"
_BUCKET_RULES = {
    "s3": "S3 bucket names are 3-255 letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
    "gs": "GCS bucket names are 3-222 lowercase letters, digits, '-', '_' or '.' (no '..'), "
    "starting and ending with a letter or digit",
}


@dataclass(frozen=True, slots=True)
class StorageURI:
    """A storage root, parsed: ``scheme`` (``s3``, ``gs`` or ``file``), ``bucket`` ("" for
    ``file``) and ``path``: the prefix without slashes around it, or the absolute ``file`` path."""

    scheme: str
    bucket: str
    path: str


def is_storage_uri(uri: str) -> bool:
    """Pure: whether ``uri`` is in the grammar."""
    return len(uri) <= MAX_URI_LENGTH and _URI_RE.fullmatch(uri) is not None


def parse_storage_uri(uri: str) -> StorageURI:
    """Pure: parse a storage root; raises ValueError saying what is wrong and what to write instead."""
    if not is_storage_uri(uri):
        raise ValueError(_why_not(uri))
    scheme, _, rest = uri.partition("://")
    if scheme == "file":
        return StorageURI("file", "", rest)
    bucket, _, prefix = rest.partition("/")
    return StorageURI(scheme, bucket, prefix.strip("/"))


def parse_bucket_uri(uri: str, scheme: str) -> tuple[str, str]:
    """Pure: split ``<scheme>://bucket/prefix`` (``s3``, ``gs``) into bucket and prefix (no slashes around)."""
    if not uri.startswith(f"{scheme}://"):
        raise ValueError(f"not a {scheme}:// URI: {uri!r}")
    parsed = parse_storage_uri(uri)
    return parsed.bucket, parsed.path


def _why_not(uri: str) -> str:
    """Pure: one line on why ``uri`` is outside the grammar (only called for one that is)."""
    if len(uri) > MAX_URI_LENGTH:
        return f"storage URI longer than {MAX_URI_LENGTH} characters: {uri[:60]!r}..."
    if re.search(r"[\x00-\x1f\x7f]", uri):
        return f"control character in storage URI {uri!r}"
    scheme, sep, rest = uri.partition("://")
    if scheme == "file" or uri.startswith("file:"):
        if sep and rest and not rest.startswith("/"):
            return f"file URI with a host is not supported: {uri!r} (use file:///PATH)"
        return f"file URI must be absolute: {uri!r} (use file:///PATH)"
    if not sep or scheme not in _BUCKET_RE:
        return f"unsupported storage URI {uri!r}: use {_USE}"
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        return f"no bucket in {uri!r}: use {scheme}://BUCKET/PREFIX"
    if not _BUCKET_RE[scheme].fullmatch(bucket):
        return f"invalid bucket name {bucket!r} in {uri!r}: {_BUCKET_RULES[scheme]}"
    return f"invalid prefix in {uri!r}: no '.', '..' or empty segments (a prefix is an object key, not a path)"
