"""Story files: every accepted form, scene-transition tokens, and one-sentence errors for every kind of mistake."""

from __future__ import annotations

import json

import pytest

from tttvideo.errors import UserError
from tttvideo.sample.scenes import check_duration, load_stories, output_paths
from tttvideo.text.prompts import SCENE_END_TOKEN, SCENE_START_TOKEN

A = {"text": "a red circle moves right", "neg_text": "blurry"}
B = {"text": "a blue square moves up", "requires_scene_transition": True}
C = {"text": "the square stops", "requires_scene_transition": False, "neg_text": None}


def write(tmp_path, name, content):
    p = tmp_path / name
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return p


def test_one_story_json(tmp_path):
    [story] = load_stories(write(tmp_path, "s.json", [A, B, C]))
    assert story.name == "s" and story.num_segments == 3 and story.duration_s == 9
    assert story.prompts() == [A["text"] + SCENE_END_TOKEN, SCENE_START_TOKEN + B["text"], C["text"]]
    assert story.negative_prompts() == ["blurry", "", ""]


def test_first_scene_transition_flag_is_ignored(tmp_path):
    [story] = load_stories(write(tmp_path, "s.json", [dict(B), A]))
    assert story.prompts() == [B["text"], A["text"]]


def test_several_stories_json_and_jsonl(tmp_path):
    stories = load_stories(write(tmp_path, "many.json", [[A], [A, B]]))
    assert [s.name for s in stories] == ["many-000", "many-001"]
    assert [s.num_segments for s in stories] == [1, 2]
    lines = "\n".join(json.dumps(x) for x in ([A, B], [C])) + "\n\n"
    stories = load_stories(write(tmp_path, "lines.jsonl", lines))
    assert [s.num_segments for s in stories] == [2, 1]


def test_jsonl_one_scene_per_line(tmp_path):
    [story] = load_stories(write(tmp_path, "s.jsonl", "\n".join(json.dumps(x) for x in (A, B, C))))
    assert story.num_segments == 3 and story.scenes[1].requires_scene_transition


def test_folder_of_files_and_roundtrip_of_written_scenes(tmp_path):
    folder = tmp_path / "stories"
    folder.mkdir()
    write(folder, "b.json", [A, B])
    write(folder, "a.jsonl", json.dumps(C))
    (folder / "notes.txt").write_text("ignored")
    stories = load_stories(folder)
    assert [s.name for s in stories] == ["a", "b"]
    # what tttv sample writes beside a video reads back as the same story
    again = write(tmp_path, "out.scenes.json", stories[1].to_json({"seed": 3}))
    [back] = load_stories(again)
    assert back.scenes == stories[1].scenes


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("s.json", [{"text": "  "}], "empty text"),
        ("s.json", [{"text": "ok", "requires_transition": True}], "unknown key 'requires_transition'"),
        ("s.json", [{"text": 3}], "needs a \"text\" string"),
        ("s.json", [{"text": "ok", "requires_scene_transition": "yes"}], "true or false"),
        ("s.json", [{"text": "ok", "neg_text": 1}], "neg_text must be a string"),
        ("s.json", "[{\"text\": \"a\"},", "not valid JSON (line 1"),
        ("s.json", [], "expected a list of scenes"),
        ("s.json", [A, [A]], "mixes scenes"),
        ("s.json", {"story": [A]}, "must be {\"scenes\""),
        ("s.json", ["just text"], "mixes scenes"),
        ("s.jsonl", "{\"text\": \"a\"}\n[{\"text\": \"b\"}]", "lines mix"),
        ("s.jsonl", "{\"text\": \"a\"}\n{oops", "line 2 is not valid JSON"),
        ("s.jsonl", "\n\n", "holds no story"),
        ("s.txt", "a story", "must end in .json or .jsonl"),
    ],
)
def test_bad_files_raise_one_sentence(tmp_path, name, content, words):
    with pytest.raises(UserError) as err:
        load_stories(write(tmp_path, name, content))
    message = str(err.value)
    assert words in message
    assert "\n" not in message


def test_missing_and_unreadable(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_stories(tmp_path / "nope.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UserError, match="cannot read scenes file"):
        load_stories(tmp_path / "bin.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no .json"):
        load_stories(tmp_path / "empty")


def test_duration_must_match_scene_count(tmp_path):
    [story] = load_stories(write(tmp_path, "s.json", [A, B, C]))
    assert check_duration(story, None) == 9
    assert check_duration(story, "9s") == 9
    with pytest.raises(UserError, match=r"3 scene\(s\), i.e. 9 s .* asks for 63 s \(21 scenes\)"):
        check_duration(story, "63s")
    with pytest.raises(UserError, match="3 \\+ 3n"):
        check_duration(story, "10s")


def test_output_paths(tmp_path):
    one = load_stories(write(tmp_path, "s.json", [A]))
    many = load_stories(write(tmp_path, "m.json", [[A], [B]]))
    assert output_paths(one, tmp_path / "x.mp4") == [tmp_path / "x.mp4"]
    assert output_paths(many, tmp_path / "out") == [tmp_path / "out/m-000.mp4", tmp_path / "out/m-001.mp4"]
    with pytest.raises(UserError, match="hold 2 stories"):
        output_paths(many, tmp_path / "x.mp4")
