"""Multiple-choice task files (components/evaluation/tasks.py): each layout reads as lm-evaluation-harness
formats it, from every file format, bad input names its file and line, and the shipped next-line task
is held out and rebuilds bit for bit."""

import json
import subprocess
import sys
from collections import Counter

import pytest
from conftest import REPO

from components.evaluation.tasks import LAYOUTS, Example, parse_task_spec, read_task

TASK = REPO / "tests/assets/tasks/shakespeare_next_line.jsonl"
SHIPPED = [TASK, REPO / "tests/assets/tasks/shakespeare_word_order.jsonl"]
BUILDER = REPO / "tests/assets/build_eval_tasks.py"
TRAIN = REPO / "tests/assets/shakespeare/train.jsonl"

HELLASWAG = {
    "activity_label": "Home and Garden",
    "ctx_a": "[header] How to plant tulips [title] Dig a hole.",
    "ctx_b": "then Drop the bulb in",
    "ctx": "ignored when ctx_a and ctx_b are there",
    "endings": ["pointy end up. [step] Cover it  with soil.", " upside down.", "in a pot.", "and water [title] it"],
    "label": "2",
}
ARC = {"question": "Which gas do plants take in?", "answerKey": "C",
       "choices": {"text": ["oxygen", "helium", "carbon dioxide", "argon"], "label": ["A", "B", "C", "D"]}}
PIQA = {"goal": "To dry wet shoes,", "sol1": "stuff them with newspaper.", "sol2": "put them in the oven.", "label": 0}
GENERIC = {"context": "ROMEO.\nBut soft!", "choices": ["What light", "Good night"], "gold": 0, "delimiter": "\n"}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def error_of(spec, exception=ValueError) -> str:
    with pytest.raises(exception) as caught:
        read_task(str(spec))
    return str(caught.value)


def test_hellaswag_records_are_formatted_as_lm_eval_formats_them(tmp_path):
    task = read_task(str(write_jsonl(tmp_path / "hs.jsonl", [HELLASWAG])))
    assert task.name == "hs" and task.layout == "hellaswag"
    assert task.examples == [Example(
        context="Home and Garden: How to plant tulips. Dig a hole. Then drop the bulb in",
        choices=["pointy end up. Cover it with soil.", "upside down.", "in a pot.", "and water. it"],
        gold=2, delimiter=" ")]


def test_hellaswag_without_ctx_a_uses_ctx_and_without_activity_label_has_no_prefix(tmp_path):
    record = {"ctx": "A man sits [title] down.", "endings": ["a", "b", "c", "d"], "label": 1}
    (example,) = read_task(str(write_jsonl(tmp_path / "hs.jsonl", [record]))).examples
    assert example.context == "A man sits. down." and example.gold == 1


def test_arc_gold_is_the_index_of_answer_key_among_the_labels(tmp_path):
    task = read_task(str(write_jsonl(tmp_path / "arc.jsonl", [ARC])))
    assert task.layout == "arc"
    assert task.examples == [Example("Question: Which gas do plants take in?\nAnswer:",
                                     ["oxygen", "helium", "carbon dioxide", "argon"], 2, " ")]


def test_piqa_offers_its_two_solutions(tmp_path):
    task = read_task(str(write_jsonl(tmp_path / "piqa.jsonl", [PIQA])))
    assert task.layout == "piqa"
    assert task.examples == [Example("Question: To dry wet shoes,\nAnswer:",
                                     ["stuff them with newspaper.", "put them in the oven."], 0, " ")]


def test_generic_records_are_used_as_they_are_with_a_space_as_the_default_delimiter(tmp_path):
    plain = {key: value for key, value in GENERIC.items() if key != "delimiter"}
    task = read_task(str(write_jsonl(tmp_path / "g.jsonl", [GENERIC, plain])))
    assert task.layout == "generic"
    assert task.examples == [Example("ROMEO.\nBut soft!", ["What light", "Good night"], 0, "\n"),
                             Example("ROMEO.\nBut soft!", ["What light", "Good night"], 0, " ")]


def test_blank_lines_of_a_jsonl_file_are_skipped(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(f"\n{json.dumps(GENERIC)}\n   \n{json.dumps(GENERIC)}\n\n")
    assert len(read_task(str(path)).examples) == 2


def test_a_json_file_holds_a_list_of_records(tmp_path):
    path = tmp_path / "piqa.json"
    path.write_text(json.dumps([PIQA, PIQA]))
    assert read_task(str(path)).examples == read_task(str(write_jsonl(tmp_path / "piqa.jsonl", [PIQA, PIQA]))).examples


def test_a_parquet_file_reads_like_its_jsonl(tmp_path):
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([ARC, ARC]), tmp_path / "arc.parquet")
    task = read_task(str(tmp_path / "arc.parquet"))
    expected = read_task(str(write_jsonl(tmp_path / "arc.jsonl", [ARC, ARC]))).examples
    assert task.layout == "arc" and task.examples == expected


def test_a_save_to_disk_dataset_and_the_validation_split_of_a_dataset_dict_are_read(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_list([HELLASWAG]).save_to_disk(str(tmp_path / "one"))
    other = dict(HELLASWAG, label="0")
    DatasetDict({"train": Dataset.from_list([other]), "validation": Dataset.from_list([HELLASWAG]),
                 "test": Dataset.from_list([other])}).save_to_disk(str(tmp_path / "hellaswag"))
    expected = read_task(str(write_jsonl(tmp_path / "hs.jsonl", [HELLASWAG]))).examples
    assert read_task(str(tmp_path / "one")).examples == expected
    task = read_task(str(tmp_path / "hellaswag"))
    assert task.name == "hellaswag" and task.examples == expected


def test_a_spec_may_name_the_task_and_otherwise_the_file_stem_names_it(tmp_path):
    path = write_jsonl(tmp_path / "piqa_val.jsonl", [PIQA])
    assert parse_task_spec(f"piqa={path}") == ("piqa", path)
    assert parse_task_spec(str(path)) == ("piqa_val", path)
    assert read_task(f"mine={path}").name == "mine"
    assert parse_task_spec("data/a=b.jsonl")[0] == "a=b"


def test_limit_keeps_the_first_examples(tmp_path):
    records = [dict(PIQA, label=i % 2) for i in range(5)]
    path = write_jsonl(tmp_path / "piqa.jsonl", records)
    assert [e.gold for e in read_task(str(path), limit=3).examples] == [0, 1, 0]
    assert len(read_task(str(path), limit=0).examples) == 5


def test_a_missing_field_names_the_file_line_and_what_the_layout_needs(tmp_path):
    path = write_jsonl(tmp_path / "hs.jsonl", [HELLASWAG] * 6 + [{"ctx": "x", "label": 0}])
    message = error_of(path)
    assert f"{path} line 7: no field 'endings'" in message
    assert "the hellaswag layout needs ctx or ctx_a/ctx_b, endings, label" in message


@pytest.mark.parametrize("record, field", [
    (dict(HELLASWAG, label=4), "label 4"), (dict(PIQA, label=2), "label 2"), (dict(GENERIC, gold=-1), "gold -1"),
])
def test_a_gold_out_of_range_names_the_file_and_line(tmp_path, record, field):
    path = write_jsonl(tmp_path / "t.jsonl", [record, record])
    assert f"{path} line 1: {field} is out of range for" in error_of(path)


def test_an_answer_key_not_among_the_labels_names_the_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "arc.jsonl", [ARC, ARC, dict(ARC, answerKey="E")])
    assert f"{path} line 3: answerKey 'E' is not among the choices' labels" in error_of(path)


def test_invalid_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(GENERIC) + "\n" + '{"context": "a", "choices": [\n')
    assert f"{path} line 2: invalid JSON" in error_of(path)


def test_an_unknown_layout_lists_the_fields_found_and_every_layout(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "b"}])
    message = error_of(path)
    assert f"{path} line 1" in message and "['answer', 'prompt']" in message
    for name, layout in LAYOUTS.items():
        assert f"{name} ({layout.needs})" in message


def test_a_missing_path_raises_file_not_found_naming_it(tmp_path):
    assert str(tmp_path / "nope.jsonl") in error_of(tmp_path / "nope.jsonl", FileNotFoundError)


def test_an_empty_file_has_no_examples(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert f"{path}: the task file has no examples" in error_of(path)


@pytest.mark.parametrize("choices, problem", [
    (["only"], "needs at least 2 choices, found 1"), (["a", " "], "choice 2 is empty"),
])
def test_too_few_choices_or_an_empty_one_names_the_file_and_line(tmp_path, choices, problem):
    path = write_jsonl(tmp_path / "g.jsonl", [GENERIC, dict(GENERIC, choices=choices)])
    message = error_of(path)
    assert f"{path} line 2: " in message and problem in message


def test_rows_and_items_are_counted_from_one(tmp_path):
    import pyarrow
    import pyarrow.parquet

    bad = dict(PIQA, label=5)
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([PIQA, bad]), tmp_path / "p.parquet")
    assert f"{tmp_path / 'p.parquet'} row 2: label 5" in error_of(tmp_path / "p.parquet")
    (tmp_path / "p.json").write_text(json.dumps([bad]))
    assert f"{tmp_path / 'p.json'} item 1: label 5" in error_of(tmp_path / "p.json")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_shipped_task_has_hundreds_of_four_way_examples_with_evenly_spread_answers(path):
    task = read_task(str(path))
    assert task.layout == "generic" and len(task.examples) >= 300
    assert all(len(e.choices) == 4 and e.delimiter == "" and e.context.endswith("\n") for e in task.examples)
    golds = Counter(e.gold for e in task.examples)
    assert all(abs(golds[i] - len(task.examples) / 4) < len(task.examples) / 10 for i in range(4))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_shipped_task_is_held_out_from_the_training_split(path):
    train = "\n\n".join(json.loads(line)["text"] for line in TRAIN.read_text(encoding="utf-8").splitlines())
    assert [e.context for e in read_task(str(path)).examples if e.context in train] == []


def test_word_order_choices_hold_the_same_words_as_the_answer():
    for example in read_task(str(SHIPPED[1])).examples:
        answer = example.choices[example.gold]
        assert len(set(example.choices)) == 4
        assert all(sorted(c.split(" ")) == sorted(answer.split(" ")) for c in example.choices)


def test_the_build_script_regenerates_the_shipped_tasks_bit_for_bit(tmp_path):
    subprocess.run([sys.executable, str(BUILDER), "--output-dir", str(tmp_path)], check=True, capture_output=True)
    for path in SHIPPED:
        assert (tmp_path / path.name).read_bytes() == path.read_bytes()
