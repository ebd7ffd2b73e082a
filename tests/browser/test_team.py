"""A team on one server: many sessions running at once, a sweep that outlives its tab and its server, and a login.

Eight threads drive the store and the device queue through the code the pages run, and two Chromium contexts run
live runs against one ``streamlit run`` server at the same time; every run is stored exactly once. A sweep started
in a browser goes on after its tab is closed, is cut short by SIGKILL, and is resumed after a restart into a
complete grid without duplicates. With an ``[auth]`` section in the server's secrets, a visitor sees only the login.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator

import pytest
from browser import Server, idle, launch, needs_chromium

from kvlab.budget import Budget
from kvlab.dashboard.grid import NeedleGridRequest
from kvlab.dashboard.sweep_jobs import SweepJobs
from kvlab.runs.device_queue import DeviceQueue, Ticket, Waiting
from kvlab.runs.live import LiveRun, LiveSettings, NeedleTask, build_prompt
from kvlab.runs.live_store import store_live_run
from kvlab.store import open_store

pytestmark = pytest.mark.model

sync_api = pytest.importorskip("playwright.sync_api")


class WatchedQueue(DeviceQueue):
    """A device queue that counts how many runs hold the device at once."""

    def __init__(self) -> None:
        super().__init__(poll_seconds=0.1)
        self.holding = 0
        self.most = 0
        self._count = threading.Lock()

    @contextlib.contextmanager
    def turn(self, label: str, on_wait=None) -> Iterator[Ticket]:
        with super().turn(label, on_wait) as ticket:
            with self._count:
                self.holding += 1
                self.most = max(self.most, self.holding)
            try:
                yield ticket
            finally:
                with self._count:
                    self.holding -= 1


@pytest.mark.slow
def test_eight_sessions_at_once_take_turns_and_store_every_run_exactly_once(tmp_path, shipped):
    loaded = shipped
    store = open_store(tmp_path / "runs.duckdb")
    queue = WatchedQueue()
    jobs = SweepJobs(queue)
    start = threading.Barrier(8)
    places: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def live_session(index: int) -> None:
        policy = ("h2o", "streaming", "snapkv", "full")[index]
        prompt = build_prompt(loaded, NeedleTask(128, depth=index / 4, seed=index))
        settings = LiveSettings(policy, {}, Budget(keep=0.5), "streaming", chunk=64, max_new_tokens=4)
        live = LiveRun(loaded, prompt, settings)
        start.wait()
        seen = places.setdefault(f"live {index}", [])
        with live.on_device(queue, lambda waiting: seen.append(waiting.ahead)) as events:
            for _ in events:
                pass
        assert store_live_run(store, live, live.outcome(), f"user{index}") is not None

    def sweep_session(index: int, policies: tuple[str, ...]) -> None:
        request = NeedleGridRequest(loaded.name, policies, 0.5, "prefill", (256,), depths=2, trials=1, batch_size=2)
        start.wait()
        job = jobs.start(request, loaded, store, f"user{index}")
        seen = places.setdefault(f"sweep {index}", [])
        while job.active:
            if isinstance(job.waiting, Waiting) and not seen:
                seen.append(job.waiting.ahead)
            job.join(0.1)
        assert job.status == "finished", job.message

    def session(work, *args) -> None:
        try:
            work(*args)
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    grids = [("full", "h2o"), ("full", "streaming"), ("h2o", "random"), ("full", "h2o")]  # the last repeats the first
    threads = [threading.Thread(target=session, args=(live_session, i)) for i in range(4)]
    threads += [threading.Thread(target=session, args=(sweep_session, 4 + i, grid)) for i, grid in enumerate(grids)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert errors == []
    assert queue.most == 1
    waited = [name for name, seen in places.items() if seen]
    assert len(waited) >= 6 and all(ahead >= 1 for seen in places.values() for ahead in seen)

    runs = store.list_runs()
    assert len(runs) == 8 and set(runs["status"]) == {"finished"}
    assert not runs.duplicated(["policy", "mode", "task", "keep", "context_length", "seed"]).any()
    live = runs[runs["task"] == "needle"].query("context_length == 128")
    assert sorted(live["started_by"]) == [f"user{i}" for i in range(4)] and set(live["trials"]) == {1}
    swept = runs[runs["context_length"] == 256]
    assert sorted(swept["policy"]) == ["full", "h2o", "random", "streaming"] and set(swept["trials"]) == {2}
    trials = store.trials_frame()
    assert len(trials) == 4 + 8 and not trials.duplicated(["run_id", "trial_key"]).any()
    assert [record.status for record in store.sweeps()] == ["finished"] * 3
    store.close()


# Set in the page when a notice that the run waits for the device appears, however briefly.
WATCH_WAITING = """() => {
  window.sawWaiting = false;
  new MutationObserver(() => {
    if (document.body.innerText.includes('Waiting for the device: 1 run is ahead of yours.')) window.sawWaiting = true;
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


@pytest.mark.browser
@pytest.mark.long
@needs_chromium
def test_two_browsers_run_at_once_and_both_runs_are_stored(tmp_path):
    database = tmp_path / "runs.duckdb"
    with Server({"KVLAB_DB": str(database)}) as server, sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        tabs = []
        for seed in (1, 2):
            tab = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            tab.set_default_timeout(90_000)
            tab.goto(f"{server.url}/live")
            tab.get_by_text("Running on").wait_for()
            # long enough (about 1.3 s of the engine) that the second click reaches the queue while the first runs
            tab.get_by_role("spinbutton", name="Context length (tokens)").fill("2048")
            tab.get_by_role("spinbutton", name="Seed (key, value and haystack)").fill(str(seed))
            tab.get_by_role("spinbutton", name="Tokens to generate (at most)").fill("4")
            tab.get_by_role("spinbutton", name="Tokens to generate (at most)").press("Enter")
            idle(tab)
            tab.evaluate(WATCH_WAITING)
            tabs.append(tab)
        for tab in tabs:
            tab.get_by_role("button", name="Run", exact=True).click()
        stored = []
        for tab in tabs:
            tab.get_by_text("stored as run").wait_for()
            stored.append(int(re.search(r"stored as run (\d+)", tab.get_by_text("stored as run").inner_text())[1]))
        waited = [tab.evaluate("window.sawWaiting") for tab in tabs]
        browser.close()
    assert sorted(stored) == [1, 2]
    assert sorted(waited) == [False, True]  # one ran while the other was told its place
    with open_store(database) as store:
        runs = store.list_runs()
        assert runs["run_id"].tolist() == [1, 2] and sorted(runs["seed"]) == [1, 2]
        assert runs["trials"].tolist() == [1, 1] and set(runs["status"]) == {"finished"}


def progress(tab) -> tuple[int, int]:
    """Trials done and in all of the sweep the needle grid page shows in progress."""
    text = tab.locator("[data-testid=stProgress]").first.inner_text()
    done, total = re.search(r"(\d+) of (\d+) trials", text).groups()
    return int(done), int(total)


@pytest.mark.browser
@pytest.mark.long
@needs_chromium
def test_a_sweep_outlives_its_tab_and_a_killed_server_and_resumes_complete(tmp_path):
    database = tmp_path / "runs.duckdb"
    server = Server({"KVLAB_DB": str(database)})
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(server.stop)
        browser = launch(cleanup.enter_context(sync_api.sync_playwright()))

        def needle_grid_tab():
            tab = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            tab.set_default_timeout(90_000)
            tab.goto(f"{server.url}/needle_grid")
            tab.get_by_text("Running on").wait_for()
            idle(tab)
            return tab

        server.start()
        starter = needle_grid_tab()
        for chip in ("streaming", "random", "1024"):
            starter.get_by_role("button", name=f"Remove {chip}").click()
            idle(starter)
        depths = starter.locator("[data-testid=stSlider]", has_text="Depths").get_by_role("slider")
        depths.focus()
        depths.press("Home")  # two depths: 0 and 1
        starter.get_by_role("spinbutton", name="Trials per cell").fill("4")
        starter.get_by_role("spinbutton", name="Batch size").fill("1")
        starter.get_by_role("spinbutton", name="Batch size").press("Enter")
        idle(starter)
        starter.get_by_role("button", name="Run grid").click()
        starter.get_by_text("Sweep 1 runs on the server").wait_for()
        starter.context.close()  # the tab that started the sweep is gone

        watcher = needle_grid_tab()
        watcher.get_by_text("Sweep 1: full, h2o · keep 0.1 · prefill · 512 tokens · 2 depths x 4 trials").wait_for()
        watcher.wait_for_function(
            "[...document.querySelectorAll('[data-testid=stProgress]')]"
            ".some(e => /[1-9]\\d* of 16 trials/.test(e.innerText))"
        )
        done, total = progress(watcher)
        assert 1 <= done < total == 16
        server.kill()
        watcher.context.close()

        with open_store(database) as store:  # what the restarted server will find
            stored = int(store.list_runs()["trials"].sum())
            assert done <= stored < 16
            assert [record.status for record in store.sweeps()] == ["interrupted"]
            assert set(store.list_runs()["status"]) == {"interrupted"}

        server.start()
        resumer = needle_grid_tab()
        resumer.get_by_text("Interrupted when its server stopped").wait_for()
        resumer.get_by_role("button", name="Resume").click()
        resumer.get_by_text(f"Ran {16 - stored} trials; {stored} were already stored.").wait_for()
        browser.close()
    with open_store(database) as store:
        trials = store.trials_frame()
        assert len(trials) == 16 and not trials.duplicated(["run_id", "trial_key"]).any()
        grid = sorted(f"depth={depth:.4f}/trial={trial}" for depth in (0.0, 1.0) for trial in range(4))
        assert trials.groupby("policy")["trial_key"].apply(sorted).to_dict() == {"full": grid, "h2o": grid}
        assert set(store.list_runs()["status"]) == {"finished"}
        assert [record.status for record in store.sweeps()] == ["finished"]


@pytest.mark.browser
@pytest.mark.long
@needs_chromium
def test_with_a_login_configured_a_visitor_sees_only_the_login(tmp_path):
    secrets = tmp_path / "secrets.toml"
    secrets.write_text(
        '[auth]\nredirect_uri = "http://127.0.0.1:8501/oauth2callback"\n'
        'cookie_secret = "a-cookie-secret-of-32-characters"\nclient_id = "kvlab"\n'
        'client_secret = "not-a-secret"\n'
        'server_metadata_url = "http://127.0.0.1:9/.well-known/openid-configuration"\n'
    )
    env = {"KVLAB_DB": str(tmp_path / "runs.duckdb")}
    with Server(env, "--secrets.files", str(secrets)) as server, sync_api.sync_playwright() as playwright:
        browser = launch(playwright)
        for path in ("/needle_grid", "/", "/runs"):  # a page's own address first, while the server is fresh
            tab = browser.new_context().new_page()
            tab.set_default_timeout(60_000)
            tab.goto(server.url + path)
            tab.get_by_role("button", name="Log in").wait_for()
            idle(tab)
            assert tab.get_by_role("heading", name="kvlab", exact=True).is_visible()
            for hidden in ("Needle grid", "Runs", "Live run", "Model", "Running on", "Runs are stored"):
                assert tab.get_by_text(hidden, exact=True).count() == 0, (path, hidden)
            assert tab.locator("[data-testid=stSidebarNav]").count() == 0
            tab.context.close()
        tab = browser.new_context().new_page()
        tab.goto(server.url)
        with tab.expect_navigation():  # to Streamlit's OIDC route, which would redirect to the provider
            tab.get_by_role("button", name="Log in").click()
        assert "/auth/login?provider=" in tab.url
        browser.close()
    assert not (tmp_path / "runs.duckdb").exists()  # nothing was opened for a visitor
