"""What a KVCachePolicy field may hold: the limits and patterns the CRD states, the tier values,
:class:`PolicyError`, and the readers that turn a raw value into a field's value or a PolicyError.

A reader is ``(value, field name) -> value | PolicyError``; it never raises. :mod:`kvoffload.policy`
names which reader each ``spec`` field uses; the sidecar's and the connector's env readers use them too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.quantity import QuantityError, parse_bytes

MODES = ("sidecar", "node")
EVICTION_POLICIES = ("LRU", "ARC")
BACKENDS = (c.BACKEND_SIDECAR, c.BACKEND_INPROCESS)
CONNECTOR_SOURCES = ("init-container", "image")
GPU_ACCESS_MODES = ("nvidia-runtime", "none")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
CHUNK_SIZE_MULTIPLE = 16
"""TensorRT-LLM's tokens_per_block is a power of two >= 16; a chunk must hold whole blocks."""
MIN_CHUNK_SIZE = CHUNK_SIZE_MULTIPLE
MAX_CHUNK_SIZE = 65536
MIN_WORKERS, MAX_WORKERS = 1, 64
MIN_TIMEOUT_MS, MAX_TIMEOUT_MS = 1, 600_000
MAX_QUANTITY = "1Pi"
"""Largest shmSize / l1Size the CRD admits (a typo such as 20Pi is refused, not scheduled)."""
RESOURCE_KEYS = ("limits", "requests")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
REDIS_URL = re.compile(c.REDIS_URL_PATTERN)
IMAGE_PATTERN = r"^[^\x00-\x20\x7f]+$"
"""An image reference: one token, no space or control characters (else every pod fails to pull); the CRD's."""
IMAGE = re.compile(IMAGE_PATTERN)
MAX_IMAGE_LENGTH = 1024
KV_EVENTS_TOPIC_PATTERN = r"^[^\x00-\x20\x7f]*$"
"""A KV-event topic: one token, no spaces or control characters (a ZMQ topic is a byte prefix; llm-d
parses ``kv@<pod>@<model>`` from it); the CRD's."""
KV_EVENTS_TOPIC = re.compile(KV_EVENTS_TOPIC_PATTERN)
MAX_KV_EVENTS_TOPIC_LENGTH = 256
KV_EVENTS_FORMATS = ("vllm", "vllm-positional")
"""KV-event wire formats: vLLM >= 0.24's tagged maps (the default), vLLM <= 0.23's positional arrays."""
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""A Secret's name (DNS-1123 subdomain, at most 253 characters); the CRD's."""
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr",
                "/boot", "/run", "/var/run")  # fmt: skip
"""Directories of the container's own system: an L2 directory may be none of them nor lie inside one."""
_CEL_LIST = "[" + ", ".join(f"'{p}'" for p in (*SYSTEM_TREES, *c.RESERVED_MOUNT_PATHS)) + "]"
_CEL_OWN = "[" + ", ".join(f"'{p}'" for p in c.RESERVED_MOUNT_PATHS) + "]"
FS_PATH_RULES = (
    "self.startsWith('/')",
    "!self.matches('(^|/)[.][.](/|$)') && !self.contains('\\x00')",
    "self == '/' || (!self.endsWith('/') && !self.contains('//') && !self.matches('(^|/)[.](/|$)'))",
    f"self != '/' && !{_CEL_LIST}.exists(p, self == p || self.startsWith(p + '/'))",
    f"!{_CEL_OWN}.exists(p, p.startsWith(self + '/'))",
)
"""The CRD's CEL rules for the L2 path, in the order of :func:`fs_path_problem`'s checks (which
the operator and the sidecar apply): absolute; no '..' part or NUL; written plainly; not a system
directory nor one of kvoffload's mounts, nor inside one; not holding one of kvoffload's mounts."""
_K8S_QUANTITY = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$")
"""Kubernetes' resource.Quantity syntax (any unit: cpu, memory, extended resources)."""
_RESOURCE_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


WORKLOAD_DEPENDENT = "workload_dependent"
"""``PolicyError.reason`` of a value valid in itself (the CRD admits it) that this workload's engine
or the operator's defaults cannot use: the operator refuses it per workload, with an Event."""


@dataclass(frozen=True)
class PolicyError:
    """Why a value cannot be used: the field, the value and what would be allowed."""

    field: str
    value: object
    allowed: str
    reason: str = "invalid_settings"
    """Short machine-readable cause, used as the error metric's ``reason`` label."""

    @property
    def message(self) -> str:
        return f"{self.field}: {' '.join(repr(self.value).split())} is not allowed; {self.allowed}"


@dataclass(frozen=True)
class FsTier:
    """Local-filesystem L2 tier: a directory and the bytes it may hold."""

    path: str
    size_bytes: int


@dataclass(frozen=True)
class RedisTier:
    """Redis L2 tier: its URL inline or from a Secret (``url_secret_*``, exactly one of the two); the
    password, if any, from a Secret."""

    url: str | None = None
    password_secret_name: str | None = None
    password_secret_key: str | None = None
    url_secret_name: str | None = None
    url_secret_key: str | None = None
    """Where the URL is when not inline: the cache server gets it by env ``valueFrom``, so neither the
    operator's writes nor its webhook's answers ever carry it."""


# --- field readers: (value, field name) -> value | PolicyError ----------------


@dataclass(frozen=True)
class PolicyField:
    """One settable field: where it sits in the ``spec``, the :class:`Policy` attribute, its reader."""

    path: tuple[str, ...]
    attr: str
    read: Callable[[object, str], Any]

    @property
    def spec_path(self) -> str:
        return ".".join(self.path)


def lookup_path(spec: Mapping[str, Any], path: tuple[str, ...]) -> tuple[bool, object]:
    """Whether ``spec`` sets the nested ``path``, and its value there."""
    node: object = spec
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def read_fields(
    spec: Mapping[str, Any], sections: tuple[str, ...], fields: tuple[PolicyField, ...], where: str
) -> dict[str, Any] | PolicyError:
    """Each field ``spec`` sets, read by its reader, by attribute; the first bad one's error (a
    section that is not an object first)."""
    for section in sections:
        if section in spec and not isinstance(spec[section], Mapping):
            return PolicyError(f"{where}.{section}", spec[section], "an object")
    values: dict[str, Any] = {}
    for f in fields:
        present, raw = lookup_path(spec, f.path)
        if not present:
            continue
        value = f.read(raw, f"{where}.{f.spec_path}")
        if isinstance(value, PolicyError):
            return value
        values[f.attr] = value
    return values


def read_choice(allowed: tuple[str, ...]) -> Callable[[object, str], str | PolicyError]:
    def read(value: object, name: str) -> str | PolicyError:
        if isinstance(value, str) and value in allowed:
            return value
        return PolicyError(name, value, "allowed: " + ", ".join(allowed))

    return read


def read_int(lo: int, hi: int, multiple: int = 1) -> Callable[[object, str], int | PolicyError]:
    def read(value: object, name: str) -> int | PolicyError:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            return PolicyError(name, value, f"an integer from {lo} to {hi}")
        if value % multiple:
            return PolicyError(name, value, f"a multiple of {multiple} (whole TensorRT-LLM blocks)")
        return value

    return read


def read_quantity(
    minimum: str | None = None, maximum: str = MAX_QUANTITY
) -> Callable[[object, str], int | PolicyError]:
    """A byte quantity (``20Gi``) greater than 0, at least ``minimum`` and at most ``maximum``."""
    span = f"from {minimum} to {maximum}" if minimum else f"greater than 0 and at most {maximum}"
    why = " (LMCache's L1 must hold whole chunks)" if minimum else ""
    allowed = f"a byte quantity {span}{why}, such as 20Gi (suffix Ki, Mi, Gi, Ti, Pi or k, M, G, T, P)"
    low, high = (parse_bytes(minimum, "minimum") if minimum else 1), parse_bytes(maximum, "maximum")

    def read(value: object, name: str) -> int | PolicyError:
        if not isinstance(value, str):
            return PolicyError(name, value, allowed)
        try:
            size = parse_bytes(value, name)
        except QuantityError:
            return PolicyError(name, value, allowed)
        return size if low <= size <= high else PolicyError(name, value, allowed)

    return read


def read_bool(value: object, name: str) -> bool | PolicyError:
    return value if isinstance(value, bool) else PolicyError(name, value, "true or false")


def read_mapping(value: object, name: str) -> Mapping[str, Any] | PolicyError:
    return value if isinstance(value, Mapping) else PolicyError(name, value, "an object")


def read_image(value: object, name: str) -> str | PolicyError:
    if isinstance(value, str) and len(value) <= MAX_IMAGE_LENGTH and IMAGE.fullmatch(value):
        return value
    return PolicyError(name, value, "an image reference without spaces or control characters")


def read_kv_events_topic(value: object, name: str) -> str | PolicyError:
    if isinstance(value, str) and len(value) <= MAX_KV_EVENTS_TOPIC_LENGTH and KV_EVENTS_TOPIC.fullmatch(value):
        return value
    return PolicyError(
        name, value, f"at most {MAX_KV_EVENTS_TOPIC_LENGTH} characters without spaces or control characters, "
        "such as kv@$(KVOFFLOAD_POD_IP):8000@my-model",
    )  # fmt: skip


def read_runtime_class(value: object, name: str) -> str | None | PolicyError:
    if value in (None, ""):
        return None
    if isinstance(value, str) and DNS_LABEL.fullmatch(value):
        return value
    return PolicyError(name, value, "a DNS-1123 label or empty")


def read_resources(value: object, name: str) -> Mapping[str, Any] | None | PolicyError:
    """A container ``resources`` object: only limits/requests, each resource name -> quantity."""
    res = read_mapping(value, name)
    if isinstance(res, PolicyError):
        return res
    for key, amounts in res.items():
        if key not in RESOURCE_KEYS:
            return PolicyError(f"{name}.{key}", amounts, "allowed keys: " + ", ".join(RESOURCE_KEYS))
        if not isinstance(amounts, Mapping):
            return PolicyError(f"{name}.{key}", amounts, "an object of resource name to quantity")
        for resource, amount in amounts.items():
            if not isinstance(resource, str) or not _RESOURCE_NAME.fullmatch(resource):
                return PolicyError(f"{name}.{key}", resource, "a resource name such as memory or cpu")
            text = str(amount) if isinstance(amount, int) and not isinstance(amount, bool) else amount
            if not isinstance(text, str) or not _K8S_QUANTITY.fullmatch(text) or text.startswith("-"):
                return PolicyError(f"{name}.{key}.{resource}", amount, "a non-negative quantity such as 8Gi or 500m")
    return dict(res) or None


REDIS_URL_FORM = "redis://[user@]host[:port][/0]"


def read_redis_url(value: object, name: str) -> str | PolicyError:
    """A URL LMCache's Redis adapter can use: plain Redis, database 0, no password in it."""
    if isinstance(value, str) and REDIS_URL.fullmatch(value):
        return value
    text = value if isinstance(value, str) else ""
    if re.match(r"^rediss?://[^/@]*:[^/@]*@", text):
        shown = re.sub(r"//([^:/@]*):[^@]*@", r"//\1:***@", text)
        return PolicyError(name, shown, f"keep the password out of the URL (a Secret holds it): {REDIS_URL_FORM}")
    if text.startswith("rediss://"):
        why = "LMCache's Redis adapter speaks plain Redis, not TLS"
    elif re.match(r"^redis://[^/]*/.", text) and not re.match(r"^redis://[^/]*/0$", text):
        why = "LMCache's Redis adapter uses database 0 only"
    else:
        why = "LMCache's Redis adapter: plain Redis, database 0"
    return PolicyError(name, value, f"{REDIS_URL_FORM} ({why})")


def is_plain_absolute_path(path: object) -> bool:
    """An absolute path with no '..' part and no NUL (the CRD's first two ``FS_PATH_RULES``)."""
    return isinstance(path, str) and path.startswith("/") and "\x00" not in path and ".." not in path.split("/")


def _within(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree + "/")


def fs_path_problem(path: object) -> str | None:
    """Why ``path`` cannot be the L2 directory (mounted in the cache server's container), or None."""
    if not isinstance(path, str) or not is_plain_absolute_path(path):
        return "an absolute path without '..'"
    if path != "/" and (path.endswith("/") or "//" in path or "." in path.split("/")):
        return "written plainly: no trailing '/', no '//', no '.' part"
    own = next((m for m in c.RESERVED_MOUNT_PATHS if _within(path, m)), None)
    if own is not None:
        return f"kvoffload mounts or ships {own} itself (a directory there collides with it); choose a directory of its own, such as /var/cache/kvoffload-l2"
    system = next((t for t in SYSTEM_TREES if _within(path, t)), None)
    if path == "/" or system is not None:
        where = "/" if path == "/" else system
        return f"{where} is the container's own system tree; choose a directory of its own, such as /var/cache/kvoffload-l2"
    held = next((m for m in c.RESERVED_MOUNT_PATHS if m.startswith(path + "/")), None)
    if held is not None:
        return (
            f"it holds {held}, which kvoffload mounts; choose a directory of its own, such as /var/cache/kvoffload-l2"
        )
    return None


def read_fs_tier(value: object, name: str) -> FsTier | PolicyError:
    fs = read_mapping(value, name)
    if isinstance(fs, PolicyError):
        return fs
    path = fs.get("path")
    problem = fs_path_problem(path)
    if problem is not None:
        return PolicyError(f"{name}.path", path, problem)
    assert isinstance(path, str)
    size = read_quantity()(fs.get("size"), f"{name}.size")
    return size if isinstance(size, PolicyError) else FsTier(path=path, size_bytes=size)


def read_secret_key_ref(value: object, name: str) -> tuple[str, str] | PolicyError:
    """``{name, key}`` of a Secret in the policy's namespace."""
    ref_map = read_mapping(value, name)
    if isinstance(ref_map, PolicyError):
        return ref_map
    secret, key = ref_map.get("name"), ref_map.get("key")
    if not isinstance(secret, str) or len(secret) > 253 or not re.fullmatch(SECRET_NAME_PATTERN, secret):
        return PolicyError(f"{name}.name", secret, "a Secret name")
    if not isinstance(key, str) or not key or len(key) > 253:
        return PolicyError(f"{name}.key", key, "a key of that Secret")
    return secret, key


def read_redis_tier(value: object, name: str) -> RedisTier | PolicyError:
    redis = read_mapping(value, name)
    if isinstance(redis, PolicyError):
        return redis
    inline, from_secret = redis.get("url"), redis.get("urlSecretRef")
    if (inline is None) == (from_secret is None):
        return PolicyError(name, "url" if inline is not None else "<neither>",
                           "set exactly one of url (inline) and urlSecretRef (a Secret holding the URL)")  # fmt: skip
    url_fields: dict[str, str]
    if from_secret is not None:
        url_ref = read_secret_key_ref(from_secret, f"{name}.urlSecretRef")
        if isinstance(url_ref, PolicyError):
            return url_ref
        url_fields = {"url_secret_name": url_ref[0], "url_secret_key": url_ref[1]}
    else:
        url = read_redis_url(inline, f"{name}.url")
        if isinstance(url, PolicyError):
            return url
        url_fields = {"url": url}
    if redis.get("passwordSecretRef") is None:
        return RedisTier(**url_fields)
    password = read_secret_key_ref(redis.get("passwordSecretRef"), f"{name}.passwordSecretRef")
    if isinstance(password, PolicyError):
        return password
    return RedisTier(**url_fields, password_secret_name=password[0], password_secret_key=password[1])
