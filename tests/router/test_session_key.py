"""Session ids: header, then body fields, then a fingerprint of the chat's opening."""

from tandem.router.sessions import session_key


def chat(*msgs):
    return {"messages": [{"role": r, "content": c} for r, c in msgs]}


def test_explicit_ids_win_in_order():
    body = {**chat(("user", "hi")), "session_id": "body-sid", "user": "u1"}
    assert session_key({"x-session-id": "hdr"}, body, []) == "hdr"
    assert session_key({}, body, []) == "body-sid"
    assert session_key({}, {**chat(("user", "hi")), "user": "u1"}, []) == "u1"


def test_fingerprint_sticks_across_turns_and_separates_sessions():
    t1 = chat(("system", "You are a coding agent."), ("user", "Fix the bug in parser.py"))
    t2 = chat(("system", "You are a coding agent."), ("user", "Fix the bug in parser.py"),
              ("assistant", "Done."), ("user", "Now add a test."))
    other = chat(("system", "You are a coding agent."), ("user", "Refactor lexer.py"))
    a, b, c = (session_key({}, x, []) for x in (t1, t2, other))
    assert a is not None and a.startswith("fp-")
    assert a == b          # later turns keep the session
    assert a != c          # another task is another session


def test_plain_completion_without_ids_has_no_session():
    assert session_key({}, {"prompt": "hello"}, [1, 2, 3]) is None
