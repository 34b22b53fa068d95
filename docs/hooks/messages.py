"""MkDocs hook: the troubleshooting page's catalogue of every message the package can show.

The messages are the ``_MSG_*`` string constants of ``checkpointing/`` (house rule: a long
user-facing text is such a constant, next to where it is raised or warned). They are read from
the source with ``ast``, not imported, so the site builds without torch, and the catalogue
cannot fall behind the code. The page holds the marker ``<!-- messages catalogue -->`` where the
catalogue goes.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parents[2] / "checkpointing"
MARKER = "<!-- messages catalogue -->"

# Which part of the library speaks, by module (the first match of the module's dotted path wins).
AREAS: list[tuple[str, str]] = [
    ("_checkpoint", "checkpoint()"),
    ("_reentrant", "checkpoint(use_reentrant=True)"),
    ("_frame", "non-reentrant checkpoint: frames, recompute, early stop"),
    ("_determinism", "determinism checks and debug=True"),
    ("_state", "RNG, autocast and device state; recompute_state_hooks"),
    (
        "_selective",
        "selective checkpointing (create_selective_checkpoint_contexts)",
    ),
    ("policies", "checkpointing.policies"),
    ("_keep", "keep() and keeping()"),
    ("_kept_span", "keep() and keeping()"),
    ("_offload", "offload to host memory"),
    ("_scope", "gradient_checkpoint_scope and gradient_checkpoint_session"),
    ("_sequential", "checkpoint_sequential"),
    ("_schedule", "checkpoint_sequential schedules"),
    ("_module", "checkpoint_module"),
    ("_wrappers", "checkpoint_wrapper and apply_activation_checkpointing"),
    ("_auto_wrap", "checkpoint_wrapper and apply_activation_checkpointing"),
    (
        "_host_saves",
        "checkpoint_wrapper and apply_activation_checkpointing",
    ),
    ("_planning", "plan_checkpointing and ActivationPlan"),
    ("_report", "saved_tensors_report and report_on_oom"),
    ("_compiled", "torch.compile"),
    ("integrations", "integrations.transformers"),
    ("_compat", "import and torch releases"),
    (
        "_errors",
        "internal errors (a bug in checkpointing: please report it)",
    ),
]


def messages() -> dict[str, list[tuple[str, str]]]:
    """``{area: [(constant name, text), ...]}`` for every ``_MSG_*`` string constant."""
    found: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        dotted = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        area = next(
            (label for prefix, label in AREAS if dotted.startswith(prefix)),
            "other",
        )
        strings: dict[
            str, str
        ] = {}  # the module's string constants so far, by name
        for node in ast.parse(path.read_text()).body:
            target, value = _assigned(node)
            if target is None:
                continue
            text = _string(value, strings)
            if text is None:
                continue  # not a string known before the program runs
            strings[target] = text
        for (
            name,
            text,
        ) in (
            strings.items()
        ):  # each at its last value, in order of first binding
            if name.startswith("_MSG_"):
                found.setdefault(area, []).append(
                    (f"{dotted}.{name}", text)
                )
    order = [label for _, label in AREAS] + ["other"]
    return {
        label: found[label]
        for label in dict.fromkeys(order)
        if label in found
    }


def _string(node: Any, strings: dict[str, str]) -> str | None:
    """The value of a string literal, of a name bound to one, or of their ``+``; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return strings.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = (
            _string(node.left, strings),
            _string(node.right, strings),
        )
        return None if left is None or right is None else left + right
    return None


def _assigned(node: ast.stmt) -> tuple[str | None, Any]:
    """The name a module-level statement binds and the expression it binds it to (``x += y``
    binds ``x + y``: a message completed after its first lines keeps its whole text)."""
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
        if isinstance(node.target, ast.Name):
            return node.target.id, ast.BinOp(
                ast.Name(node.target.id), ast.Add(), node.value
            )
        return None, None
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        return (
            target.id if isinstance(target, ast.Name) else None
        ), node.value
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        return (
            node.target.id if isinstance(node.target, ast.Name) else None
        ), node.value
    return None, None


def catalogue() -> str:
    """The catalogue as Markdown: one section per area, each message as a text block."""
    parts: list[str] = []
    for area, items in messages().items():
        parts += [f"### {area}", ""]
        for name, text in items:
            # A message is one long line: "wrap" blocks wrap (docs/assets/site.css).
            parts += [
                f"`{name}`",
                "",
                "```{.text .wrap}",
                text.strip(),
                "```",
                "",
            ]
    return "\n".join(parts)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs event: put the catalogue where the page has the marker."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, catalogue())
