"""The files of installed Python packages that may hold a model, found without making a path of every file.

Listing the models that packages carry (:mod:`kvlab.models.catalog`, :mod:`kvlab.models.parts`) reads every installed
package's file list. ``Distribution.files`` makes a path object of each entry: in an environment with torch and
transformers that is about 140,000 of them, 4.9 s of a 2-core machine's time in a fresh dashboard's first page (its
sidebar lists the models), where the few files wanted are known by name. So each package's ``RECORD`` is read as
text and only the entries whose names are wanted become paths.
"""

from __future__ import annotations

import csv
import importlib.metadata
from collections.abc import Callable
from importlib.metadata import Distribution
from pathlib import Path


def package_files(wanted: Callable[[str], bool]) -> list[tuple[Distribution, Path]]:
    """Every installed package's files whose name as the package lists it (``data/model.gguf``) ``wanted`` accepts,
    each with its distribution."""
    return [
        (distribution, Path(str(distribution.locate_file(item))))
        for distribution in importlib.metadata.distributions()
        for item in listed_files(distribution)
        if wanted(item)
    ]


def listed_files(distribution: Distribution) -> list[str]:
    """The files a package lists, as text: its ``RECORD``'s first column (a CSV file, so a name with a comma is
    quoted), or where it has none (an egg, a distribution without a record) its files as ``importlib.metadata``
    reads them."""
    record = distribution.read_text("RECORD")
    if record is None:
        return [str(item) for item in distribution.files or []]
    return [row[0] for row in csv.reader(record.splitlines()) if row]
