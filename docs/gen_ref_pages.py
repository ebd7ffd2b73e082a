"""Generate one API reference page per module of the kvlab package, and the reference section's navigation.

Run by the mkdocs-gen-files plugin at build time: it walks the package's source files, so a module that is added,
moved or removed changes the reference with no edit here. The pages hold only a mkdocstrings directive; the
docstrings are read by static analysis, without importing kvlab.
"""

from __future__ import annotations

from pathlib import Path

import mkdocs_gen_files

PACKAGE = "kvlab"
root = Path(__file__).parent.parent
nav = mkdocs_gen_files.Nav()

for path in sorted((root / PACKAGE).rglob("*.py")):
    module_path = path.relative_to(root).with_suffix("")
    parts = tuple(module_path.parts)
    if parts[-1] == "__main__" or any(part.startswith("_") and part != "__init__" for part in parts):
        continue
    doc_path = Path("reference", *parts).with_suffix(".md")
    if parts[-1] == "__init__":
        parts = parts[:-1]
        doc_path = doc_path.with_name("index.md")
    nav[parts] = doc_path.relative_to("reference").as_posix()
    with mkdocs_gen_files.open(doc_path, "w") as page:
        page.write(f"# `{'.'.join(parts)}`\n\n::: {'.'.join(parts)}\n")
    mkdocs_gen_files.set_edit_path(doc_path, path.relative_to(root))

with mkdocs_gen_files.open("reference/index.md", "w") as page:
    page.write(
        "# API reference\n\n"
        "One page per module of the `kvlab` package, generated from its docstrings each time the site is built, so "
        "it follows the code as modules are added or moved. Start with the package overview, "
        "[`kvlab`](kvlab/index.md), or the task guides: [Python API](../guides/python-api.md), "
        "[Write a policy](../guides/write-a-policy.md).\n"
    )

with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as summary:
    summary.write("* [Overview](index.md)\n")
    summary.writelines(nav.build_literate_nav())
