"""History entries read back from a browser (issue 21, issue 58): the browser can rewrite them, so
a result counts only by its opaque id with this server's signature for this browser's secret and
while the server serves it; thumbnails must be our small JPEG data URIs; settings are validated
like any request, and only the first MAX_ENTRIES are looked at."""

from __future__ import annotations

from PIL import Image

from hidream_ui.server.files import ServedResults
from hidream_ui.ui.history_entries import (
    MAX_ENTRIES,
    added,
    browser_secret,
    chains,
    check_entries,
    new_browser_secret,
    new_entry,
    picker_choices,
    render_entries,
    signed,
)

BROWSER = new_browser_secret()


def opener(served: ServedResults, secret: str = BROWSER):
    """check_entries' opener for a browser holding `secret` (as handlers._history_view binds it)."""
    return lambda result, ticket: served.stored(result, ticket, secret)


def _served_entry(tmp_path, name="a.png", served=None, secret=BROWSER, **params):
    served = served or ServedResults()
    path = tmp_path / name
    Image.new("RGB", (16, 12), (10, 200, 30)).save(path)
    served.add(path)
    picture = Image.new("RGB", (16, 12))
    entry = new_entry(
        result=served.result_id(path),
        name=path.name,
        params={"instruction": "make it <b>red</b>", "seed": 7, **params},
        before=picture,
        after=picture,
    )
    return served, signed(entry, lambda result: served.ticket(result, secret))


def test_a_signed_served_result_is_available(tmp_path):
    served, entry = _served_entry(tmp_path)
    [checked] = check_entries([entry], opener(served))
    assert checked.available and checked.png == str(tmp_path / "a.png")
    assert str(tmp_path) not in repr(entry)  # the browser keeps an id, never the path
    assert checked.before.startswith("data:image/jpeg;base64,") and checked.params.seed == 7
    assert "seed 7" in checked.readable_settings() and "steps 28" in checked.readable_settings()
    html = render_entries([checked])
    assert "make it &lt;b&gt;red&lt;/b&gt;" in html and "<b>red" not in html  # the instruction is text


def test_a_forged_foreign_or_copied_entry_is_never_available(tmp_path):
    served, entry = _served_entry(tmp_path)
    _, second = _served_entry(tmp_path, "b.png", served=served)
    other_server = ServedResults()  # another process: another key
    _, foreign = _served_entry(tmp_path, "c.png", served=other_server)
    secret = tmp_path / "secret.png"
    Image.new("RGB", (4, 4)).save(secret)
    forged = [
        {**entry, "ticket": "0" * 64},  # right id, made-up signature
        {**entry, "result": second["result"]},  # another result's id with this one's signature
        {**entry, "png": str(secret), "result": None},  # a path: never read
        foreign,  # signed by another server
        {**entry, "ticket": None},
        {**entry, "result": entry["result"] * 1000},
    ]
    checked = check_entries(forged, opener(served))
    assert len(checked) == 6 and not any(entry.available or entry.png for entry in checked)
    assert render_entries(checked).count("no longer on this server") == 6
    # The same entry in another browser (another secret): not on this server; back home it opens.
    assert not check_entries([entry], opener(served, new_browser_secret()))[0].available
    assert check_entries([entry], opener(served))[0].available


def test_an_entry_of_an_older_version_keeps_its_settings_only(tmp_path):
    """Before issue 58 an entry held the result's server path and a signature of the path alone."""
    served, entry = _served_entry(tmp_path)
    old = {key: value for key, value in entry.items() if key not in ("result", "ticket")}
    old.update(png=str(tmp_path / "a.png"), ticket="ab" * 32)
    [checked] = check_entries([old], opener(served))
    assert not checked.available and checked.png is None and checked.params.seed == 7
    assert "no longer on this server" in render_entries([checked])


def test_a_deleted_result_keeps_its_settings_only(tmp_path):
    served, entry = _served_entry(tmp_path)
    (tmp_path / "a.png").unlink()
    [checked] = check_entries([entry], opener(served))
    assert not checked.available and checked.params.instruction == "make it <b>red</b>"


def test_a_result_retention_deleted_loses_its_id(tmp_path):
    served, entry = _served_entry(tmp_path)
    (tmp_path / "a.png").unlink()
    served.add()  # retention ran: the result is no longer served, nor mapped
    assert served.result_id(tmp_path / "a.png") is None
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")  # a new file at the old path: not the result
    assert not check_entries([entry], opener(served))[0].available


def test_the_browser_secret_is_kept_when_well_formed_and_made_otherwise():
    kept = new_browser_secret()
    assert browser_secret(kept) == kept
    for sent in (None, "", "short", kept + "x", 7, ["list"], "ä" * 43):
        made = browser_secret(sent)
        assert made != sent and browser_secret(made) == made


def test_what_is_not_an_entry_is_left_out_and_bad_thumbnails_dropped(tmp_path):
    served, entry = _served_entry(tmp_path)
    hostile = {**entry, "before": 'x" onerror="alert(1)', "after": "data:image/svg+xml;base64,PHN2Zz4="}
    junk = [None, 3, "text", {"params": {"instruction": ""}}, {"params": {"instruction": "x", "seed": "many"}}]
    checked = check_entries(junk + [hostile], opener(served))
    assert len(checked) == 1
    assert checked[0].before is None and checked[0].after is None
    assert "onerror" not in render_entries(checked) and "svg" not in render_entries(checked)
    assert check_entries("not a list", opener(served)) == []


def test_new_entries_go_first_and_the_list_stays_bounded(tmp_path):
    _, entry = _served_entry(tmp_path)
    history = []
    for seed in range(MAX_ENTRIES + 5):
        history = added(history, {**entry, "params": {"instruction": f"edit {seed}", "seed": seed}})
    assert len(history) == MAX_ENTRIES and history[0]["params"]["seed"] == MAX_ENTRIES + 4
    checked = check_entries(history, lambda *_: False)
    assert picker_choices(checked)[0] == (f"1. edit {MAX_ENTRIES + 4} · seed {MAX_ENTRIES + 4}", 0)
    assert added(history, None) == history


def _chained(tmp_path, instructions: list[str], served: ServedResults) -> list[dict]:
    """One entry per instruction, each made from the previous one's result (newest first)."""
    history, parent = [], None
    for index, instruction in enumerate(instructions):
        _, entry = _served_entry(tmp_path, f"r{index}.png", served=served, instruction=instruction)
        sha = f"{index + 1:064x}"
        link = {"file": "x.png", "sha256": parent, "of": "file"} if parent else None
        entry = {**entry, "sha256": sha, "parent": link}
        history, parent = added(history, entry), sha
    return history


def test_history_draws_the_chain_an_edit_was_made_in(tmp_path):
    served = ServedResults()
    history = _chained(tmp_path, ["make it blue", "add a hat", "make it <i>night</i>"], served)
    history = added(
        history,
        new_entry(
            result=None,
            name=None,
            params={"instruction": "alone", "seed": 1},
            before=Image.new("RGB", (8, 8)),
            after=Image.new("RGB", (8, 8)),
        ),
    )
    checked = check_entries(history, opener(served))  # newest first: alone, night, hat, blue
    links = chains(checked)
    assert 0 not in links  # an edit of an upload: no chain
    assert (links[1].step, links[1].length, links[1].parent) == (3, 3, 2)
    assert (links[3].step, links[3].length, links[3].parent) == (1, 3, None)
    cards = render_entries(checked).split('class="hui-h-card"')[1:]
    assert "chain" not in cards[0]
    assert "edit 3 of a chain of 3 · from result 3: “add a hat”" in cards[1]
    assert "edit 2 of a chain of 3 · from result 4: “make it blue”" in cards[2]
    assert "edit 1 of a chain of 3" in cards[3] and "from result" not in cards[3]


def test_a_forged_chain_loops_nowhere_and_names_only_entries_of_this_history(tmp_path):
    served = ServedResults()
    first, second = _chained(tmp_path, ["one", "two"], served)[::-1]
    looped = [{**second}, {**first, "parent": {"sha256": second["sha256"]}}]  # each the other's parent
    links = chains(check_entries(looped, opener(served)))
    assert {link.length for link in links.values()} == {2}
    strangers = [{**second, "parent": {"sha256": "f" * 64}}, {**first, "sha256": "not hex", "parent": None}]
    assert chains(check_entries(strangers, opener(served))) == {}
    assert "chain" not in render_entries(check_entries(strangers, opener(served)))
