"""The three kinds of table, each declared once: its file name, the fields that make a file one, its
sections (lists of rows), how it parses into what its reader uses, and the one serialiser.

Every kind carries the same version header (HEADER): the device and what the measurement depends on
besides it (torch, Triton, the driver), the date, and the one command that measures it again. The
lookup compares the header with this process (tables/__init__.py); `write` refuses a table without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from tp_overlap_plugin.options import DESIGNS
from tp_overlap_plugin.tables.bucketed import BUCKETED_FIELDS, BucketedTable, GemmTable

# the fields of a table's header that say what it was measured under (tables.versions() makes them)
VERSION_KEYS = ("torch", "triton", "driver")
# every kind's header; a per-world kind's has "world" after the device
HEADER = ("device", "date", *VERSION_KEYS, "command")


@dataclass(frozen=True)
class Section:
    """A list of rows in a dispatch table: its JSON field, the `tp-overlap tune` phase whose
    measurements make it (tuning/rules.py builds it), the Dispatcher field that holds it, and whether
    a table has it even where the phase measured nothing (an empty list)."""
    key: str
    phase: str
    field: str
    always: bool = False


# the dispatch table's sections: the one copy of its schema
DISPATCH_SECTIONS = (
    Section("gemm", "fused_ops", "gemm", always=True),            # AG-GEMM / GEMM-RS vs sequential
    Section("all_reduce", "all_reduce", "all_reduce", always=True),  # ours vs NCCL per message size
    Section("all_reduce_norm", "all_reduce", "norm_rows"),        # the fused all-reduce + norm vs unfused
    Section("gemm_all_reduce", "gemm_ar", "gemm_all_reduce_rows"),  # GEMM + all-reduce in one kernel
    Section("gemv", "gemv", "gemv_rows"),                         # our GEMV vs F.linear
    Section("gemm_silu_mul", "silu_mul", "silu_mul_rows"),        # gate_up + SiLU-mul in one kernel
    Section("engine", "engine", "engine_rows"),                   # the engine's verdict per step size
)


def _dispatch_fields(data: dict, make: None = None) -> dict:
    """A dispatch table's JSON -> the Dispatcher's fields; TypeError where a field is not what it should be."""
    fields: dict[str, Any] = {}
    for s in DISPATCH_SECTIONS:
        rows = data.get(s.key, [])
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise TypeError(f"{s.key!r} must be a list of rows (objects)")
        fields[s.field] = rows
    fields["one_shot_max_bytes"] = data.get("one_shot_max_bytes")
    fields["fused_ops"] = data.get("fused_ops", "kernel")
    if fields["fused_ops"] not in DESIGNS:
        raise TypeError(f"'fused_ops' must be one of {DESIGNS}, got {fields['fused_ops']!r}")
    if "margin" in data:  # (else the Dispatcher's own)
        fields["margin"] = float(data["margin"])
    return fields


@dataclass(frozen=True)
class Kind:
    """One kind of table. `parse(data, make)`: the JSON as its reader uses it (`make` turns a config's
    fields into the reader's config class, for the bucketed kinds); `dump(table)`: its text on disk."""
    name: str
    per_world: bool                   # one table per device and world size (else per device)
    fields: tuple[str, ...]           # besides the header, what a file must hold to be a table
    parser: Callable[[dict, Any], Any]
    sections: tuple[Section, ...] = ()

    @property
    def folder(self) -> str:
        """The shipped tables' folder in the package (the cache's folder is the kind's name)."""
        return f"{self.name}_tables"

    @property
    def header(self) -> tuple[str, ...]:
        return HEADER[:1] + (("world",) if self.per_world else ()) + HEADER[1:]

    def file_name(self, device_key: str, world: int | None = None) -> str:
        """"dispatch": <device>-tp<W>.json (one per device and world size); "gemm", "decode": <device>.json."""
        return f"{device_key}-tp{world}.json" if self.per_world else f"{device_key}.json"

    def parse(self, data: dict, make: Callable[[dict], Any] | None = None) -> Any:
        return self.parser(data, make)

    def dump(self, table: dict) -> str:
        return dump(table)

    def check(self, table: dict, device_name: str, world: int | None) -> None:
        """ValueError unless `table` is one of this kind for this device (and world size) that its
        readers parse: the header, the kind's fields, rows that are rows."""
        missing = [k for k in self.header + self.fields if k not in table]
        if missing:
            raise ValueError(f"a {self.name} table needs the fields {missing}; it has {sorted(table)}")
        if table["device"] != device_name:
            raise ValueError(f"the {self.name} table is of {table['device']!r}, written as {device_name!r}'s")
        if self.per_world and table["world"] != world:
            raise ValueError(f"the {self.name} table is of TP={table['world']}, written as TP={world}'s")
        try:
            self.parse(table, dict)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"the {self.name} table does not parse ({type(e).__name__}: {e})") from e


DISPATCH = Kind("dispatch", True, ("all_reduce",), _dispatch_fields, DISPATCH_SECTIONS)
GEMM = Kind("gemm", False, (*BUCKETED_FIELDS, "cublas_below", "margin"), GemmTable.parse)
DECODE = Kind("decode", False, BUCKETED_FIELDS, BucketedTable.parse)
KINDS = {k.name: k for k in (DISPATCH, GEMM, DECODE)}


def kind_named(name: str) -> Kind:
    if name not in KINDS:
        raise ValueError(f"table kind must be one of {sorted(KINDS)}, got {name!r}")
    return KINDS[name]


def dump(table: dict) -> str:
    """The one serialiser: keys sorted, one line per row of a list of rows and per item of an object, so
    that a table's diff reads as the list of changed choices; everything else on its field's line."""
    lines = []
    for key, value in sorted(table.items()):
        name = json.dumps(key)
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            body = ",\n".join("  " + json.dumps(v, sort_keys=True) for v in value)
            lines.append(f" {name}: [\n{body}\n ]")
        elif isinstance(value, dict) and value:
            body = ",\n".join(f"  {json.dumps(str(k))}: {json.dumps(v, sort_keys=True)}"
                              for k, v in sorted(value.items()))
            lines.append(f" {name}: {{\n{body}\n }}")
        else:
            lines.append(f" {name}: {json.dumps(value, sort_keys=True)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"
