"""The connector's shared folder: made when missing, and why not when it cannot be written."""

from llmgw.agent import connector_folder


def test_a_missing_folder_is_made_and_left_empty(tmp_path):
    folder = tmp_path / "a" / "kv"
    assert connector_folder.unwritable(str(folder)) is None
    assert folder.is_dir() and list(folder.iterdir()) == []  # the probe file is gone


def test_an_existing_folder_keeps_what_it_holds(tmp_path):
    (tmp_path / "prompt-hash").mkdir()
    assert connector_folder.unwritable(str(tmp_path)) is None
    assert [p.name for p in tmp_path.iterdir()] == ["prompt-hash"]


def test_a_path_through_a_file_says_why(tmp_path):
    (tmp_path / "file").write_text("")
    # Root writes through any permission bits; a file in the path stops everyone.
    assert connector_folder.unwritable(str(tmp_path / "file" / "kv")) == "Not a directory"


def test_a_file_where_the_folder_should_be_says_so(tmp_path):
    (tmp_path / "kv").write_text("")
    assert connector_folder.unwritable(str(tmp_path / "kv")) == "it is a file, not a folder"


def test_a_folder_that_never_answers_costs_the_probe_its_deadline_not_the_agent(monkeypatch):
    import threading

    hung = threading.Event()
    monkeypatch.setattr(connector_folder, "_probe", lambda path: hung.wait() and None)
    try:
        why = connector_folder.unwritable("/mnt/stale", timeout=0.2)
    finally:
        hung.set()  # let the left-behind probe thread end
    assert why == "no answer from the folder within 0.2 s (a hung mount?)"
