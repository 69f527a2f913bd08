"""The persistent compile cache: what graphopt compiled, kept on disk so that the
next process that meets the same graph skips the work.

    key   = sha256(graph code, input metadata, constants, the config fields that
                   change the result, user patterns, graphopt's sources, torch, device)
    entry = <cache_dir>/<key[:2]>/<key>: one JSON header line (format, key, versions,
            the payload's HMAC-SHA256 signature), then the payload (pickled)

Level 1 stores the optimized ATen graph and its lowered form; level 2 stores only
graphopt's records, next to Inductor's own FX graph and AOTAutograd caches, which
hold the compiled code. Both store the report records of the compile, so a hit
still gives a full `report()`. Only a directory this user owns and nobody else can
write is used, and an entry is unpickled only when its signature matches
(`cache_trust.py`). An entry that does not parse, is truncated, was written for
another key or version or without this directory's key is logged, counted and
rebuilt. A writer writes a temporary file in the same directory and renames it over
the entry (atomic), so two processes storing one entry at once leave one whole
entry, never a broken one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pickle
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any, Collection

import torch
import torch.fx

from . import cache_trust
from ._compat import cache as compat
from ._compat import fake
from ._compat.names import OpOverload
from .kernels import IMPLEMENTATIONS
from .report import FallbackKind, GraphRecord, Report

FORMAT = 2


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """What an entry is only valid for. graphopt's sources stand for its version:
    an edited checkout must not load what an older one stored."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return {"graphopt": digest.hexdigest()[:16], "torch": torch.__version__,
            "python": f"{sys.version_info[0]}.{sys.version_info[1]}", "cpu": cpu_model()}


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU an entry is valid for: level 2's C++ code is built for its vector
    instructions and its GEMM choices were timed on it."""
    name = ""
    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.partition(":")[2].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine()} ({torch.backends.cpu.get_cpu_capability()})"


def cache_key(*parts: str) -> str:
    digest = hashlib.sha256(json.dumps(versions(), sort_keys=True).encode())
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def describe_graph(gm: torch.fx.GraphModule, inputs: list) -> str:
    """Everything about `gm` that decides what compiling it gives: its code, the
    metadata of each input (shapes, symbolic where the graph's are, strides, dtypes,
    devices) and what its get_attr nodes read: tensors by value, subgraphs (the
    bodies of higher-order ops) by their own description."""
    lines = [gm.code]
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        traced = node.meta.get("val", node.meta.get("example_value"))
        lines.append(f"{node.name}: {describe_value(traced if isinstance(traced, torch.Tensor) else value)}")
    for name, value in sorted(_attributes(gm).items()):
        if isinstance(value, torch.fx.GraphModule):
            lines.append(f"{name}: {describe_graph(value, [])}")
        elif isinstance(value, torch.Tensor):
            lines.append(f"{name}: {describe_value(value)} {tensor_digest(value)}")
        else:
            lines.append(f"{name}: {describe_value(value)}")
    return "\n".join(lines)


def describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"tensor({tuple(str(s) for s in value.shape)}, stride={tuple(str(s) for s in value.stride())}, "
                f"{value.dtype}, {value.device.type}, grad={value.requires_grad})")
    if isinstance(value, torch.SymInt):
        return "symint"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def tensor_digest(tensor: torch.Tensor) -> str:
    if fake.is_fake(tensor) or tensor.device.type == "meta":
        return "fake"
    with fake.outside_fake_mode():  # a CUDA tensor's bytes are read on the host
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()[:16]


def _attributes(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """What each get_attr node of `gm` reads, by target."""
    return {str(node.target): functools.reduce(getattr, str(node.target).split("."), gm)
            for node in gm.graph.find_nodes(op="get_attr")}


def dump_graph(gm: torch.fx.GraphModule, leave_out: Collection[str] = ()) -> dict:
    """A picklable form of `gm`: its nodes in order, each target by name, and the
    tensors its get_attr nodes read, but for those named in `leave_out` (values a
    later process computes itself and gives `load_graph`). Node metadata (fake
    tensors) is left out. Raises ValueError for a target that cannot be found again
    by its name."""
    nodes = []
    for node in gm.graph.nodes:
        target = _target_ref(node.target) if node.op == "call_function" else node.target
        arguments = torch.fx.node.map_aggregate((node.args, dict(node.kwargs)), _to_ref)
        try:
            pickle.dumps(arguments)
        except Exception as error:  # noqa: BLE001 - whatever pickle refuses, the graph cannot be stored
            raise ValueError(f"node {node.name} has an argument that cannot be stored ({error})") from None
        nodes.append((node.op, node.name, target, arguments))
    attributes = {name: value for name, value in _attributes(gm).items() if name not in leave_out}
    for name, value in attributes.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"get_attr {name} reads a {type(value).__name__}; only tensor attributes can be stored")
    return {"nodes": nodes, "attributes": attributes}


def load_graph(stored: dict, attributes: dict[str, torch.Tensor] | None = None) -> torch.fx.GraphModule:
    """The graph `dump_graph` stored, reading `attributes` for what it left out."""
    graph = torch.fx.Graph()
    defined: dict[str, torch.fx.Node] = {}
    for op, name, target, arguments in stored["nodes"]:
        args, kwargs = torch.fx.node.map_aggregate(
            arguments, lambda a: defined[a.name] if isinstance(a, _Ref) else a)
        target = _resolve(target) if op == "call_function" else target
        defined[name] = graph.create_node(op, target, tuple(args), dict(kwargs), name)
    read = {str(node.target) for node in graph.find_nodes(op="get_attr")}
    given = {name: value for name, value in (attributes or {}).items() if name in read}
    return torch.fx.GraphModule({**stored["attributes"], **given}, graph)


class _Ref:
    """A node named in a stored graph's arguments."""

    def __init__(self, name: str):
        self.name = name


def _to_ref(value: Any) -> Any:
    return _Ref(value.name) if isinstance(value, torch.fx.Node) else value


def _target_ref(target: Any) -> tuple[str, str]:
    if isinstance(target, OpOverload):
        ref = ("op", target.name())
    elif target in _implemented_ops():
        ref = ("implementation", _implemented_ops()[target].name())
    else:
        ref = ("python", compat.qualified_name(target))
    if _resolve(ref) is not target:
        raise ValueError(f"the graph calls {target!r}, which cannot be found again by the name {ref[1]!r}")
    return ref


def _resolve(ref: tuple[str, str]) -> Any:
    kind, name = ref
    if kind == "python":
        return compat.object_by_name(name)
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    op = getattr(getattr(getattr(torch.ops, namespace), op_name), overload or "default")
    return IMPLEMENTATIONS[op] if kind == "implementation" else op


@functools.lru_cache(maxsize=1)
def _implemented_ops() -> dict[Any, Any]:
    return {fn: op for op, fn in IMPLEMENTATIONS.items()}


class CompileCache:
    """One cache directory, read and written for one Backend (whose `report` counts
    hits, misses and rebuilt entries)."""

    def __init__(self, directory: str | os.PathLike, report: Report):
        self.directory = Path(directory)
        self.report = report
        self._key: bytes | None = None

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / key

    def load(self, key: str) -> Any | None:
        """The payload stored under `key`, or None. A broken entry is removed and
        reported, and None returned so that the caller rebuilds it."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as error:
            self.report.fallback(FallbackKind.CACHE_NOT_LOADED,
                                 f"cache_dir: could not read {path} ({error}); compiling instead")
            return None
        signing_key = self._signing_key()
        if signing_key is None:
            return None
        try:
            payload = _parse(data, key, signing_key)
        except Exception as error:  # noqa: BLE001 - any unreadable entry is rebuilt, never trusted
            self.report.cache_rebuilt += 1
            self.report.fallback(FallbackKind.CACHE_NOT_LOADED,
                                 f"cache_dir: entry {path} is unusable ({error}); it is compiled again "
                                 "and rewritten")
            path.unlink(missing_ok=True)
            return None
        return payload

    def store(self, key: str, payload: Any) -> bool:
        """Store `payload` under `key`; whether it was written (a failure is reported)."""
        try:
            # Outside the compiler's FakeTensorMode: pickling a CUDA tensor copies it to the host.
            with fake.outside_fake_mode():
                body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # noqa: BLE001 - an unpicklable argument costs the entry, not the compile
            self.report.fallback(FallbackKind.CACHE_NOT_STORED,
                                 f"cache_dir: a compiled graph could not be serialised ({type(error).__name__}: "
                                 f"{error}); it is compiled again in every process")
            return False
        return self.write(key, body)

    def write(self, key: str, body: bytes) -> bool:
        """Write the entry `key` holding `body` (a pickle), signed with this directory's key;
        whether it was written."""
        path = self.path(key)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as error:
            self._unwritable(path, error)
            return False
        signing_key = self._signing_key()
        if signing_key is None:
            return False
        header = {"format": FORMAT, "key": key, **versions(), "hmac": cache_trust.sign(signing_key, key, body)}
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}.", suffix=".tmp")
            with os.fdopen(handle, "wb") as file:
                file.write(json.dumps(header).encode() + b"\n" + body)
            os.replace(temporary, path)
        except OSError as error:
            self._unwritable(path, error)
            return False
        return True

    def _unwritable(self, path: Path, error: OSError) -> None:
        self.report.fallback(FallbackKind.CACHE_NOT_STORED,
                             f"cache_dir: could not write {path} ({error}); the next process compiles "
                             "again. Point cache_dir (or $GRAPHOPT_CACHE_DIR) at a writable directory")

    def _signing_key(self) -> bytes | None:
        """The directory's signing key, once the directory is found trustworthy (checked
        on every use: its mode may change); None, reported, where it is refused."""
        try:
            cache_trust.check_directory(self.directory)
            if self._key is None:
                self._key = cache_trust.signing_key(self.directory)
        except cache_trust.Untrusted as why:
            self.report.fallback(FallbackKind.CACHE_OFF,
                                 f"cache_dir: refused, so nothing is loaded from it or stored in it (an entry "
                                 f"is code that runs when loaded): {why}")
            return None
        except OSError as error:
            self.report.fallback(FallbackKind.CACHE_OFF,
                                 f"cache_dir: could not read or make the signing key in {self.directory} "
                                 f"({error}); compiling without the compile cache")
            return None
        return self._key

    def store_compile(self, key: str, records: dict, graph: torch.fx.GraphModule | None,
                      lowered: torch.fx.GraphModule | None = None, leave_out: Collection[str] = ()) -> dict | None:
        """Store a compile: its report records, its final graph (for `graphs()`, where
        it can be stored) and, at level 1, the lowered graph that runs, both without
        the attributes named in `leave_out`. Counted as a miss. Returns the entry
        stored, or None where it could not be."""
        self.report.cache_misses += 1
        try:
            runs = dump_graph(lowered, leave_out) if lowered is not None else None
        except ValueError as error:
            self.report.fallback(FallbackKind.CACHE_NOT_STORED,
                                 f"cache_dir: a graph could not be stored ({error}); it is compiled "
                                 "again in every process")
            return None
        try:
            final = dump_graph(graph, leave_out) if graph is not None else None
        except ValueError:
            final = None  # level 2 runs Inductor's code: only graphs() misses it on a hit
        entry = {**records, "graph": final, "lowered": runs}
        return entry if self.store(key, entry) else None

    def restore(self, stored: dict, record: GraphRecord) -> None:
        """Report a hit as its compile was reported: the graph's record, its passes,
        memory plan and fallbacks, renumbered as this process's graph `record.index`."""
        report = self.report
        report.cache_hits += 1
        for name, value in stored["record"].items():
            setattr(record, name, value)
        record.cache_hit = True
        report.passes.extend(dataclasses.replace(p, graph=record.index) for p in stored["passes"])
        report.memory.extend(dataclasses.replace(m, graph=record.index) for m in stored["memory"])
        for kind, reason, count in stored["fallbacks"]:
            for _ in range(count):
                report.fallback(kind, reason)


def split_entry(data: bytes, key: str) -> tuple[dict, bytes]:
    """An entry's header and body. Raises ValueError, saying why, for an entry
    written for another key, format, graphopt, torch, Python or CPU."""
    line, _, body = data.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        raise ValueError("no graphopt cache header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("key") != key:
        header = header if isinstance(header, dict) else {}
        raise ValueError(f"written for another key or format ({str(header.get('key', '?'))[:12]}, "
                         f"format {header.get('format')})")
    for name, value in versions().items():
        if header.get(name) != value:
            raise ValueError(f"written by {name} {header.get(name)}, this is {value}")
    return header, body


def _parse(data: bytes, key: str, signing_key: bytes) -> Any:
    header, body = split_entry(data, key)
    if not cache_trust.verify(signing_key, key, body, header.get("hmac")):
        raise ValueError("truncated, corrupt or not written with this directory's key: its signature does not "
                         "match, so it is not unpickled")
    with compat.real_tensors():
        return pickle.loads(body)
