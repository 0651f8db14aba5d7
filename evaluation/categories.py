"""Spec-Bench category groups: the one place that maps a question's category to its reporting group."""

from __future__ import annotations

# Spec-Bench reports the eight MT-bench categories together as "MT" (multi-turn conversation).
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")

# Reporting order of the groups; "other" collects categories we do not know.
GROUPS: dict[str, tuple[str, ...]] = {
    "MT": MT_BENCH,
    "Trans": ("translation",),
    "Sum": ("summarization",),
    "QA": ("qa",),
    "Math": ("math_reasoning",),
    "RAG": ("rag",),
    "Code": ("code",),
}
OTHER = "Other"
OVERALL = "Overall"

_GROUP_OF = {category: group for group, categories in GROUPS.items() for category in categories}


def group_of(category: str) -> str:
    """The reporting group of a category (unknown categories are grouped as "Other")."""
    return _GROUP_OF.get(category, OTHER)


def group_order() -> list[str]:
    """Groups in reporting order, "Other" and "Overall" last."""
    return [*GROUPS, OTHER, OVERALL]
