"""The dashboard's pages, declared once: ``app.py`` builds its navigation from them, and the Overview's opening
paragraph names them (and the registered policies) from here, so that no text lists a page or a policy by hand."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvlab.policies import POLICIES, is_full_cache

#: Where the page scripts live, beside ``app.py``. Not ``pages/``: beside a main script, a directory of that name puts
#: a fresh Streamlit server in its legacy multipage mode until some session's script has declared its pages, and in
#: that mode a request for a page's address runs the page file alone, without ``app.py``'s host check, login and
#: sidebar (seen from a new tab opened while the first sessions of a just-started server were still importing).
PAGE_DIRECTORY = "views"


@dataclass(frozen=True)
class PageEntry:
    """One page: its script (relative to the checkout, in :data:`PAGE_DIRECTORY`), its title and icon in the
    sidebar, and what it does, as a clause that follows its title in the Overview."""

    script: str
    title: str
    icon: str
    does: str


PAGES: tuple[PageEntry, ...] = (
    PageEntry("views/overview.py", "Overview", ":material/home:", "shows what kvlab found, without a model"),
    PageEntry(
        "views/live.py",
        "Live run",
        ":material/play_circle:",
        "runs a model on a needle prompt or your text and draws every pass (or replays a stored run, two side by side)",
    ),
    PageEntry("views/needle_grid.py", "Needle grid", ":material/grid_on:", "measures the needle heatmap of policies"),
    PageEntry("views/frontier.py", "Frontier", ":material/show_chart:", "puts accuracy against memory for every run"),
    PageEntry(
        "views/costs.py", "Cost calculator", ":material/payments:", "prices a deployment, measured where it can be"
    ),
    PageEntry(
        "views/advisor.py",
        "Advisor",
        ":material/recommend:",
        "finds the cheapest configurations that keep an accuracy floor",
    ),
    PageEntry("views/claims.py", "Claims", ":material/fact_check:", "checks the articles' numbers"),
    PageEntry(
        "views/side_channel.py",
        "Side channels",
        ":material/visibility_off:",
        "asks whether a policy's ranking leaks what a prompt held",
    ),
    PageEntry("views/runs.py", "Runs", ":material/table_rows:", "lists, compares and exports every stored run"),
)


def policy_list(names: Iterable[str]) -> str:
    """The policies called ``names`` in Markdown code, the full cache last: ``a``, ``b``, …, or the full cache
    ``full``."""
    listed = list(names)
    evicting = [f"`{name}`" for name in listed if not is_full_cache(name)]
    full = [f"the full cache `{name}`" for name in listed if is_full_cache(name)]
    return ", ".join(evicting) + (", or " + full[0] if full else "")


def overview_opening(pages: Iterable[PageEntry] = PAGES, policies: Iterable[str] | None = None) -> str:
    """The Overview's first paragraph: what kvlab does, with every registered policy and every other page."""
    names = list(POLICIES if policies is None else policies)
    tour = "; ".join(f"**{page.title}** {page.does}" for page in pages if page.script != "views/overview.py")
    return (
        f"kvlab runs a causal language model with a **budgeted KV cache** and one of its {len(names)} policies "
        f"({policy_list(names)}) and shows what survives, what it costs and whether the model still "
        f"answers. {tour}. Each chart has a *How to read this* button; the camera in its tool bar saves it."
    )
