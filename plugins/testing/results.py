"""The capability matrix: one row per (check, subject, case), and how it is printed."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["passed", "failed", "declined", "warned"]
STATUSES: tuple[Status, ...] = ("passed", "failed", "declined", "warned")


@dataclass(slots=True)
class CheckResult:
    check: str  # "kernel", "attention", "platform", "plugin", "e2e"
    subject: str  # what was checked: "gemm/example_gemm", "example_attn", "example"
    case: str  # the generated case: "M=7 N=48 K=64 float16 bias"
    status: Status
    detail: str = ""  # why it failed or was declined; the measured error when it passed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ConformanceReport:
    """Everything one run of the kit found for one plugin."""

    plugin: str
    platform: str | None  # the platform under test (None when the plugin brings none and none was asked)
    interpreter: bool  # Triton kernels ran on the CPU under TRITON_INTERPRET=1
    results: list[CheckResult] = field(default_factory=list)

    def add(self, check: str, subject: str, case: str, status: Status, detail: str = "") -> CheckResult:
        result = CheckResult(check, subject, case, status, detail)
        self.results.append(result)
        return result

    @property
    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {s: 0 for s in STATUSES}
        for r in self.results:
            counts[r.status] += 1
        return counts

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def exit_code(self) -> int:
        """0 when nothing failed (declined and warned cases do not fail a run), else 1."""
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "plugin": self.plugin,
            "platform": self.platform,
            "interpreter": self.interpreter,
            "summary": self.summary,
            "ok": self.ok,
            "results": [r.to_json() for r in self.results],
        }

    def table(self, *, max_detail: int = 110) -> str:
        """A readable matrix, then the failures in full, then the counts."""
        header = ("check", "subject", "case", "status", "detail")
        rows = [(r.check, r.subject, r.case, r.status.upper() if r.status == "failed" else r.status,
                 _clip(r.detail, max_detail)) for r in self.results]
        widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header[:-1])]
        lines = [
            f"halserve conformance: plugin {self.plugin!r}, platform {self.platform or '-'}"
            + (" (Triton kernels interpreted on the CPU: TRITON_INTERPRET=1)" if self.interpreter else ""),
            "",
            "  ".join(h.ljust(w) for h, w in zip(header, widths)) + "  " + header[-1],
        ]
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
        if self.failed:
            lines += ["", "failures:"]
            lines += [f"  [{r.check}] {r.subject} ({r.case}): {r.detail}" for r in self.failed]
        counts = self.summary
        lines += ["", ", ".join(f"{counts[s]} {s}" for s in STATUSES) + (" -> OK" if self.ok else " -> FAILED")]
        return "\n".join(lines)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
