"""realm_jax.qa.answers: ORQA's answer normalisation and scoring, and the question readers."""

import logging

import pytest

from realm_jax.qa import answers as qa
from realm_jax.qa.answers import QAExample, QAFormatError
from tests.conftest import shared_path

# The first answer regex of CuratedTREC large2180-test.tsv ("How tall is Mount McKinley?").
MCKINLEY = (
    r"20\s?,?\s?(32|40)0\s?-?\s?f(ee|oo)t|6,194-meter|20,?237\s*f(oo|ee)?t|20,?073\s*f(oo|ee)?t"
    r"|6,?168\s*m|6,118\s*m|6\,194 m|20\,322 feet"
)


def shared_file(*parts: str) -> str:
    return shared_path("data", *parts)


def write(tmp_path, name: str, content) -> str:
    path = tmp_path / name
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return str(path)


# ---------------------------------------------------------------------------------------------
# normalize_answer / exact_match, each expected value worked out by hand from ORQA's steps


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Beatles", "beatles"),
        ("69,197", "69197"),
        ("U.S.", "us"),
        ("  Hello\tWORLD \n", "hello world"),
        ("an apple a day", "apple day"),
        ("banana", "banana"),  # a/an inside a word stay
        ("Athens and Thebes", "athens and thebes"),
        ("The-Beatles", "thebeatles"),  # punctuation goes first, so "the" is no longer a word
        ("A's", "as"),
        ("the", ""),
        ("1914–1918", "1914–1918"),  # the en dash is not in string.punctuation
        ("café", "cafe\u0301"),  # NFD splits é into e + U+0301, which is not punctuation
        ("ÉCOLE", "e\u0301cole"),
    ],
)
def test_normalize_answer(text, expected):
    assert qa.normalize_answer(text) == expected


@pytest.mark.parametrize(
    "prediction, gold, expected",
    [
        ("The Beatles", "beatles", True),
        ("69,197", "69197", True),
        ("U.S.", "US", True),
        ("PARIS", "paris", True),
        ("new   york", " New York ", True),
        ("café", "cafe\u0301", True),  # composed and decomposed forms agree after NFD
        ("café", "cafe", False),  # the combining accent survives
        ("the", "a", True),  # both normalise to ""
        ("banana", "bana", False),
        ("69,197 people", "69,197", False),
    ],
)
def test_exact_match(prediction, gold, expected):
    assert qa.exact_match(prediction, gold) is expected


def test_is_correct_takes_the_best_answer():
    assert qa.is_correct(["Paris", "Paris, France"], "paris france", False)
    assert qa.is_correct(("14 December 1972 UTC", "December 1972"), "december 1972", False)
    assert not qa.is_correct(["Paris", "Lyon"], "Marseille", False)
    assert not qa.is_correct([], "anything", False)


# ---------------------------------------------------------------------------------------------
# regex_match (ORQA: re.match, anchored at the start) and the host-side helpers


@pytest.mark.parametrize(
    "prediction, pattern, expected",
    [
        ("20,320 feet", MCKINLEY, True),
        ("20320 foot", MCKINLEY, True),
        ("20,320 FEET", MCKINLEY, True),  # IGNORECASE
        ("20,320 feet tall", MCKINLEY, True),  # anchored at the start only
        ("6,194-meter", MCKINLEY, True),
        ("about 20,320 feet", MCKINLEY, False),  # .match, not .search
        ("20,100 feet", MCKINLEY, False),
        ("after the fall", "After the Fall|Finishing the Play", True),
        ("china", "China", True),
        ("People's Republic of China", "China", False),
        ("anything", "(unclosed", False),  # does not compile: never matches
    ],
)
def test_regex_match(prediction, pattern, expected):
    assert qa.regex_match(prediction, pattern) is expected


def test_regex_in_text_searches_anywhere():
    assert qa.regex_in_text(MCKINLEY, "Denali is about 20,320 feet high.")
    assert qa.regex_in_text("China", "the People's Republic of CHINA")
    assert not qa.regex_in_text("China", "Japan and Korea")
    assert not qa.regex_in_text("(unclosed", "(unclosed")


def test_is_correct_with_regex_answers():
    assert qa.is_correct(["(bad", MCKINLEY], "20,320 feet", True)
    assert not qa.is_correct(["(bad"], "(bad", True)
    assert not qa.is_correct([MCKINLEY], "about 20,320 feet", True)


@pytest.mark.parametrize(
    "answer, text, expected",
    [
        ("The Beatles", "I like the Beatles!", True),
        ("69,197", "It killed 69,197 people.", True),
        ("Paris", "Parisian cafés", False),  # whole tokens only
        ("New York", "new-york", False),  # "newyork" after normalisation
        ("the", "the end", False),  # an answer that normalises to "" is never found
        ("café", "Un café noir", True),
    ],
)
def test_answer_in_text(answer, text, expected):
    assert qa.answer_in_text(answer, text) is expected


# ---------------------------------------------------------------------------------------------
# Readers on small files


def test_read_nq(tmp_path):
    path = write(
        tmp_path,
        "dev.jsonl",
        '{"question": "who wrote it", "answer": ["Bobby Scott", "Bob Russell"]}\n'
        "\n"
        '{"question": "when", "answer": ["2017"], "id": 7}\n',
    )
    for fmt in ("auto", "nq"):
        first, second = qa.read_questions(path, fmt)
        assert first == QAExample(
            "who wrote it",
            ("Bobby Scott", "Bob Russell"),
            qid="dev.jsonl:1",
            source=f"{path}:1",
        )
        assert (second.qid, second.source, second.is_regex) == ("7", f"{path}:3", False)


def test_read_squad(tmp_path):
    path = write(
        tmp_path,
        "qa.jsonl",
        "\ufeff"
        '{"question": "How many died?", "answers": ["69,197"], "gold_passage": "train/x/0", '
        '"title": "2008 Sichuan earthquake"}\r\n'
        '{"question": "q2", "answers": ["a"], "id": "abc"}\r\n',
    )
    for fmt in ("auto", "squad"):
        first, second = qa.read_questions(path, fmt)
        assert first == QAExample(
            "How many died?",
            ("69,197",),
            title="2008 Sichuan earthquake",
            gold_passage="train/x/0",
            qid="qa.jsonl:1",
            source=f"{path}:1",
        )
        assert (second.title, second.qid, second.source) == ("", "abc", f"{path}:2")


def test_read_webquestions(tmp_path):
    path = write(
        tmp_path,
        "test.json",
        '[\n {"qId": "wqs000000", "answers": ["Jamaican English"], "qText": "what?"},\n'
        ' {"answers": ["Lawyer"], "qText": "who?"}\n]\n',
    )
    for fmt in ("auto", "webquestions"):
        first, second = qa.read_questions(path, fmt)
        assert first == QAExample(
            "what?", ("Jamaican English",), qid="wqs000000", source=f"{path}: entry 0"
        )
        assert (second.qid, second.source) == ("test.json: entry 1", f"{path}: entry 1")


def test_read_curatedtrec(tmp_path, caplog):
    path = write(
        tmp_path,
        "trec.tsv",
        f"1669\tfactoid\tHow tall is Mount McKinley?\t{MCKINLEY}\n"
        "\n"
        "462\tfactoid\tWhat is measured in curies?\tSievert \\(Sv\\)\\\t1 Sv|radiation\r\n"
        "9\tfactoid\tBroken?\t(unclosed|x\n"
        "10\tfactoid\tBroken too?\t[z\n",
    )
    with caplog.at_level(logging.WARNING, logger="realm_jax.qa.answers"):
        examples = qa.read_questions(path)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per file, with the count
    assert "2 answer regex(es) do not compile" in warnings[0].getMessage()
    assert "lines 4, 5" in warnings[0].getMessage()
    assert examples == qa.read_questions(path, "curatedtrec")
    assert examples[0] == QAExample(
        "How tall is Mount McKinley?", (MCKINLEY,), True, qid="1669", source=f"{path}:1"
    )
    # the fourth tab belongs to the regex (as in line 701 of large2180-train.tsv)
    assert examples[1].answers == ("Sievert \\(Sv\\)\\\t1 Sv|radiation",)
    assert examples[1].source == f"{path}:3"
    assert qa.is_correct(examples[1].answers, "Sievert (Sv)\t1 Sv", True)
    assert not qa.is_correct(examples[2].answers, "x", True)  # ORQA: a bad regex is wrong


def test_explicit_format_overrides_the_extension(tmp_path):
    path = write(tmp_path, "questions.txt", '{"question": "q", "answer": ["a"]}\n')
    assert qa.read_questions(path, "nq")[0].answers == ("a",)


# ---------------------------------------------------------------------------------------------
# Bad input: the error names the file and the line (or entry)

NQ_OK = '{"question": "q", "answer": ["a"]}\n'
SQUAD_OK = '{"question": "q", "answers": ["a"]}\n'

BAD = [
    # (file name, format, content, where, words in the message)
    ("a.jsonl", "nq", NQ_OK + '{"question": \n', ":2:", "invalid JSON"),
    ("a.jsonl", "nq", NQ_OK + "\n\xff", ":3:", "invalid UTF-8"),
    ("a.jsonl", "nq", '["q", ["a"]]\n', ":1:", "a list; expected one JSON object"),
    ("a.jsonl", "nq", '{"answer": ["a"]}\n', ":1:", "no 'question' field"),
    ("a.jsonl", "nq", '{"question": 5, "answer": ["a"]}\n', ":1:", "'question' is a number"),
    ("a.jsonl", "nq", NQ_OK + '{"question": " ", "answer": ["a"]}\n', ":2:", "is empty"),
    ("a.jsonl", "nq", '{"question": "q"}\n', ":1:", "no 'answer' field"),
    ("a.jsonl", "nq", '{"question": "q", "answer": "a"}\n', ":1:", "'answer' is a string"),
    ("a.jsonl", "nq", '{"question": "q", "answer": []}\n', ":1:", "empty list"),
    ("a.jsonl", "nq", '{"question": "q", "answer": ["a", 3]}\n', ":1:", "answer[1] is a number"),
    ("a.jsonl", "nq", '{"question": "q", "answer": ["a", ""]}\n', ":1:", "answer[1] is empty"),
    ("a.jsonl", "squad", SQUAD_OK + '{"question": "q", "answers": null}\n', ":2:", "is null"),
    ("a.jsonl", "squad", '{"question": "q", "answers": ["a"], "title": 1}\n', ":1:", "'title'"),
    ("a.jsonl", "squad", "\n\n", ":1:", "no questions"),
    ("a.json", "webquestions", '{"qText": "q"}', ":1:", "expected a JSON list"),
    ("a.json", "webquestions", '[\n{"qText": "q",\n', ":3:", "invalid JSON"),
    ("a.json", "webquestions", '[\n"\xe9"]', ":2:", "invalid UTF-8"),
    ("a.json", "webquestions", '[{"qText": "q", "answers": ["a"]}, 3]', ": entry 1:", "number"),
    ("a.json", "webquestions", '[{"answers": ["a"]}]', ": entry 0:", "no 'qText' field"),
    ("a.json", "webquestions", '[{"qText": "q", "answers": []}]', ": entry 0:", "empty list"),
    ("a.json", "webquestions", "[]", ":1:", "no questions"),
    ("a.json", "webquestions", "", ":1:", "no questions"),
    ("a.tsv", "curatedtrec", "1\tfactoid\tq\tr\n2\tfactoid\tq\n", ":2:", "expected 4"),
    ("a.tsv", "curatedtrec", "1\tfactoid\tq\t\n", ":1:", "answer regex (column 4) is empty"),
    ("a.tsv", "curatedtrec", "1\tfactoid\t \tr\n", ":1:", "question (column 3) is empty"),
    ("a.tsv", "curatedtrec", "\n1\tfactoid\tq\t\xe9\n", ":2:", "invalid UTF-8"),
    ("a.tsv", "curatedtrec", "", ":1:", "no questions"),
    ("a.jsonl", "auto", "\n" + '{"question": "q", "gold": ["a"]}\n', ":2:", "accepted formats"),
    ("a.jsonl", "auto", "\n[1]\n", ":2:", "expected one JSON object"),
    ("a.jsonl", "auto", "", ":1:", "no questions"),
]


@pytest.mark.parametrize("name, fmt, content, where, words", BAD)
def test_bad_input_names_file_and_line(tmp_path, name, fmt, content, where, words):
    # written as Latin-1, so "\xe9" and "\xff" above are single bytes: invalid UTF-8
    path = write(tmp_path, name, content.encode("latin-1"))
    with pytest.raises(QAFormatError) as info:
        qa.read_questions(path, fmt)
    message = str(info.value)
    assert message.startswith(f"{path}{where}"), message
    assert words in message, message


def test_unknown_extension(tmp_path):
    path = write(tmp_path, "questions.txt", NQ_OK)
    with pytest.raises(QAFormatError, match="cannot tell the question format") as info:
        qa.read_questions(path)
    assert str(info.value).startswith(f"{path}: ")


def test_missing_file_and_unknown_format(tmp_path):
    path = str(tmp_path / "nowhere.jsonl")
    with pytest.raises(FileNotFoundError) as info:
        qa.read_questions(path)
    assert path in str(info.value)
    with pytest.raises(ValueError, match="unknown question format 'csv'"):
        qa.read_questions(path, "csv")


# ---------------------------------------------------------------------------------------------
# The shared data sets


def test_shared_nq_open_dev():
    path = shared_file("openqa", "NQ-open.dev.jsonl")
    examples = qa.read_questions(path)
    assert len(examples) == 3610
    assert examples[0] == QAExample(
        "when was the last time anyone was on the moon",
        ("14 December 1972 UTC", "December 1972"),
        qid="NQ-open.dev.jsonl:1",
        source=f"{path}:1",
    )
    assert not any(e.is_regex or e.title for e in examples)


def test_shared_squad_questions():
    path = shared_file("squad", "qa_train.jsonl")
    examples = qa.read_questions(path)
    assert len(examples) == 87636
    assert examples[0] == QAExample(
        "In what year did the earthquake in Sichuan occur?",
        ("2008",),
        title="2008 Sichuan earthquake",
        gold_passage="train/2008_Sichuan_earthquake/0",
        qid="qa_train.jsonl:1",
        source=f"{path}:1",
    )
    assert examples[2].answers == ("69,197",)
    assert qa.is_correct(examples[2].answers, "69197", False)
    assert all(e.title for e in examples)


@pytest.mark.parametrize(
    "name, count, first_qid, first_question",
    [
        ("test.json", 2032, "wqs000000", "what does jamaican people speak?"),
        ("devtest.json", 189, "wqr000000", "what is the name of justin bieber brother?"),
        ("trainmodel.json", 2834, "wqr000001", None),
        ("val.json", 755, "wqr000004", None),
    ],
)
def test_shared_webquestions(name, count, first_qid, first_question):
    path = shared_file("openqa", "webquestions", name)
    examples = qa.read_questions(path)
    assert len(examples) == count
    assert examples[0].qid == first_qid
    assert examples[0].source == f"{path}: entry 0"
    if first_question is not None:
        assert examples[0].question == first_question


@pytest.mark.parametrize(
    "name, count", [("large2180-test.tsv", 694), ("large2180-train.tsv", 1479)]
)
def test_shared_curatedtrec(name, count, caplog):
    path = shared_file("openqa", "curatedtrec", name)
    with caplog.at_level(logging.WARNING, logger="realm_jax.qa.answers"):
        examples = qa.read_questions(path)
    assert len(examples) == count
    assert all(e.is_regex and len(e.answers) == 1 for e in examples)
    assert not caplog.records  # every regex in both files compiles with Python's re
    if name == "large2180-test.tsv":
        first = examples[0]
        assert (first.qid, first.question, first.answers) == (
            "1669",
            "How tall is Mount McKinley?",
            (MCKINLEY,),
        )
        assert qa.is_correct(first.answers, "20,320 feet", True)
        assert not qa.is_correct(first.answers, "about 20,320 feet", True)
    else:
        curies = examples[700]  # line 701: a tab inside the regex column
        assert curies.question == "What is measured in curies?"
        assert "\t" in curies.answers[0]
        assert qa.is_correct(curies.answers, "radiation", True)


def test_score_predictions_as_orqa_evaluate_predictions(tmp_path):
    """ORQA's evaluate_predictions_impl: a missing prediction is wrong and counted; accuracy
    is over every reference; regex references use regex_match."""
    from realm_jax.qa.answers import read_predictions, score_predictions

    refs = [
        QAExample("who wrote hamlet", ("William Shakespeare", "Shakespeare")),
        QAExample("capital of france", ("Paris",)),
        QAExample("how tall is mount mckinley", (r"20,?320\s*feet",), is_regex=True),
        QAExample("never answered", ("x",)),
    ]
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"question": "who wrote hamlet", "prediction": "shakespeare."}\n'
        '{"question": "capital of france", "prediction": "Lyon"}\n'
        '{"question": "how tall is mount mckinley", "prediction": "20320 feet high"}\n'
    )
    m = score_predictions(refs, read_predictions(str(path)))
    assert m == {"missing_predictions": 1, "num_correct": 2, "num_total": 4, "accuracy": 0.5}
    path.write_text('{"question": "q"}\n')
    with pytest.raises(QAFormatError, match=r"p.jsonl:1: needs string fields"):
        read_predictions(str(path))
