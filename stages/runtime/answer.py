"""Final-answer extraction and checking for GSM8K-style math completions.

This module is imported by reward code that runs on CPU-only hosts and inside
SLURM jobs before any heavy setup, so it deliberately uses the standard library
only.

Every function runs in time linear in its input.  Completions come from a
policy under training and can be arbitrarily degenerate (runaway digit
strings, repeated markers, unclosed braces), so a single quadratic corner case
would stall a whole rollout batch.
"""

from __future__ import annotations

import re

__all__ = ["extract_answer", "normalize_number", "is_correct", "boxed_text", "reference_answer"]

# GSM8K's own solutions end in "#### N"; models fine-tuned on them copy it.
_MARKER = "####"
# The LaTeX convention used by most instruction-tuned models.
_BOXED = "\\boxed"


def extract_answer(text: str) -> str | None:
    """Return the final numeric answer of ``text`` in canonical form, or None.

    Priority: the last ``#### N`` marker, else the last ``\\boxed{N}``, else
    the last number anywhere in the text.  The result is normalized as by
    :func:`normalize_number`, so two answers are equal iff their values are.
    """
    answer = _last_marker_number(text)
    if answer is not None:
        return answer
    found, answer = _last_boxed_number(text)
    if found:
        # A closed \boxed{} is the model's explicit answer even when it is not
        # a plain number (e.g. \frac{1}{2}); falling through to "last number"
        # would then grade the denominator, so report no numeric answer.
        return answer
    last = None
    for last in _NUMBER.finditer(text):
        pass
    return _canonical(last) if last is not None else None


def normalize_number(s: str) -> str | None:
    """Canonical form of one number written with common decorations.

    Accepts surrounding spaces, a leading ``+``/``-`` (before or after ``$``),
    ``$``, a trailing ``%`` and a trailing sentence period, and thousands
    separators.  Returns e.g. ``"1234.5"`` for ``" $1,234.50. "``; None if
    ``s`` is not a single number.
    """
    s = s.strip()
    # A sentence period follows any unit ("45%."), so it comes off first.
    if s.endswith("."):
        s = s[:-1].rstrip()
    s = _strip_suffix(s, "\\%")
    s = _strip_suffix(s, "%").rstrip()
    sign = ""
    s = _strip_prefix(s, "\\$")
    s = _strip_prefix(s, "$").lstrip()
    if s and s[0] in _SIGNS:
        sign, s = s[0], s[1:].lstrip()
        s = _strip_prefix(s, "\\$")
        s = _strip_prefix(s, "$").lstrip()
    match = _NUMBER.fullmatch(s)
    if match is None or match.group("sign"):
        # A second sign ("--5", "$-+5") is not a number anyone writes.
        return None
    return _canonical(match, negative=sign in _NEGATIVE_SIGNS)


def is_correct(completion: str, reference: str) -> bool:
    """Whether the final answer of ``completion`` matches ``reference``.

    ``reference`` is a GSM8K ``answer`` field (worked solution ending in
    ``#### N``), a bare answer such as ``"72"`` or ``"1,000"``, or any other
    worked solution, whose final answer is read as :func:`extract_answer`
    reads a completion's (a last ``\boxed{N}``, else its last number).  Numbers
    are compared by value; a non-numeric answer is compared as text with the
    completion's own final-answer text.
    """
    expected_text = _answer_text(reference)
    expected = normalize_number(expected_text)
    if expected is None and _MARKER not in reference and len(reference.split()) > 1:
        # Neither a bare answer (one word: "72", "1/2", "yes") nor `####`: a worked solution ending
        # otherwise ("A: 18", a \boxed{}), whose final answer is found the way a completion's is.
        expected = extract_answer(reference)
    if expected is not None:
        # Canonical forms have no redundant zeros, commas or signs, so string
        # equality is exact numeric equality without float rounding and
        # without int() on huge digit strings (quadratic, and refused past
        # 4300 digits since Python 3.11).
        return extract_answer(completion) == expected
    if expected_text == "":
        return False
    # A non-numeric answer ("\frac{1}{2}", "yes"): the completion's final-answer
    # text, or its last \boxed{} body, compared without whitespace.
    boxed = boxed_text(completion)
    return _squeeze(expected_text) in (_squeeze(_answer_text(completion)), _squeeze(boxed or ""))


def boxed_text(text: str) -> str | None:
    """The body of the last complete ``\boxed{...}`` (or the number of a
    ``\boxed N``) in ``text``, stripped; None if there is none."""
    span = _last_boxed(text)
    return None if span is None else span[1].strip()


def reference_answer(answer: str, answer_format: str) -> str | None:
    """The reference that :func:`is_correct` compares with, read from a data
    row's answer field as ``answer_format`` (data.answer_format) says: "gsm8k"
    (a worked solution ending in ``#### N``), "boxed" (the last ``\boxed{}``
    body), "plain" (the field itself). None: the field holds no answer in that
    format. "custom" answers are read by the user's reward function alone."""
    if answer_format == "gsm8k":
        return answer if _MARKER in answer else None
    if answer_format == "boxed":
        return boxed_text(answer) or None
    if answer_format == "plain":
        return answer.strip() or None
    raise ValueError(f"answer format {answer_format!r} is not read by syncrl")


# --- helpers ---------------------------------------------------------------

_SIGNS = "+-\u2212"  # U+2212 is the typographic minus some tokenizers emit.
_NEGATIVE_SIGNS = ("-", "\u2212")

# One number token.  Kept free of ambiguous nested repetition so backtracking
# stays linear: every comma group starts with a literal comma and has a fixed
# width, so there is only one way to split a digit string among the
# repetitions, and everything after the first digit run is optional, so a
# search never abandons a match it has started.
#  - A sign counts only when it cannot be a binary operator, i.e. it does not
#    follow a word character or a closing bracket ("48-24" is not -24).
#  - A comma is a thousands separator only before exactly three digits, so a
#    list like "1,2,3" yields three numbers rather than "123".
#  - ".5" is a number, but not the ".3" of "1.2.3" (that is "1.2" then "3").
#  - ASCII digits only: \d would accept other scripts' digits, which the
#    canonical form could then not compare.
_NUMBER = re.compile(
    r"(?P<sign>(?<![\w)\]])[-+\u2212])?"
    r"(?:(?P<int>[0-9]+(?:,[0-9]{3}(?![0-9]))*)(?:\.(?P<frac>[0-9]+))?"
    r"|(?<![0-9])\.(?P<lonefrac>[0-9]+))"
)
_WHITESPACE = re.compile(r"\s*")
_BRACE = re.compile(r"[{}]")
# Boxed content that is an expression even when it holds a single number
# token: \sqrt{2}, 2^{x} or 2\pi would otherwise be graded as 2.
_NOT_A_PLAIN_NUMBER = ("/", "^", "\\frac", "\\sqrt", "\\pi")


def _canonical(match: re.Match[str], negative: bool | None = None) -> str:
    """Canonical string of a ``_NUMBER`` match: no commas, no leading zeros in
    the integer part, no trailing zeros in the fraction, no sign on zero."""
    if negative is None:
        negative = match.group("sign") in _NEGATIVE_SIGNS
    integer = (match.group("int") or "").replace(",", "").lstrip("0") or "0"
    fraction = (match.group("frac") or match.group("lonefrac") or "").rstrip("0")
    value = f"{integer}.{fraction}" if fraction else integer
    if value == "0":
        return value
    return "-" + value if negative else value


def _number_at(text: str, pos: int) -> str | None:
    """The number starting at ``pos`` after optional whitespace and ``$``."""
    pos = _WHITESPACE.match(text, pos).end()
    if text.startswith("\\$", pos):
        pos = _WHITESPACE.match(text, pos + 2).end()
    elif text.startswith("$", pos):
        pos = _WHITESPACE.match(text, pos + 1).end()
    match = _NUMBER.match(text, pos)
    return _canonical(match) if match is not None else None


def _last_marker_number(text: str) -> str | None:
    """Number after the last ``####`` that is followed by one.

    A trailing marker without a number (a truncated generation) defers to an
    earlier complete one.  Linear overall: the whitespace skipped after one
    marker stops at the next marker's '#', so the skipped spans are disjoint,
    and each rfind resumes left of the previous hit.
    """
    end = len(text)
    while True:
        pos = text.rfind(_MARKER, 0, end)
        if pos < 0:
            return None
        answer = _number_at(text, pos + len(_MARKER))
        if answer is not None:
            return answer
        end = pos + len(_MARKER) - 1  # allow overlapping "#####" matches


def _last_boxed_number(text: str) -> tuple[bool, str | None]:
    """``(found, number)`` for the last complete ``\\boxed`` answer.

    ``found`` is False when there is no complete ``\\boxed{...}`` or
    ``\\boxed N``; an unclosed trailing ``\\boxed{`` (truncation) defers to an
    earlier complete one.
    """
    span = _last_boxed(text)
    if span is None:
        return False, None
    braced, body = span
    return True, _boxed_content_number(body) if braced else body


def _last_boxed(text: str) -> tuple[bool, str] | None:
    """``(braced, body)`` of the last complete ``\\boxed{body}``, or
    ``(False, number)`` of a ``\\boxed N``; None if there is neither."""
    first = text.find(_BOXED)
    if first < 0:
        return None
    # Match all braces in one pass instead of scanning forward from each
    # \boxed{, which is quadratic on many unclosed ones.
    closing: dict[int, int] = {}
    open_positions: list[int] = []
    for brace in _BRACE.finditer(text, first):
        if brace.group() == "{":
            open_positions.append(brace.start())
        elif open_positions:
            closing[open_positions.pop()] = brace.start()

    end = len(text)
    while True:
        pos = text.rfind(_BOXED, 0, end)
        if pos < 0:
            return None
        end = pos
        after = _WHITESPACE.match(text, pos + len(_BOXED)).end()
        if text.startswith("{", after):
            close = closing.get(after)
            if close is not None:
                return True, text[after + 1 : close]
        elif not text[after : after + 1].isalpha():  # "\boxedfoo" is another macro
            answer = _number_at(text, after)
            if answer is not None:
                return False, answer


def _boxed_content_number(content: str) -> str | None:
    """The number in a ``\\boxed{}`` body, tolerating units and LaTeX text
    (``42 \\text{ apples}``, ``x = 5``, ``\\$1{,}200``) but not expressions."""
    content = content.replace("{,}", ",")  # LaTeX thousands separator
    if any(marker in content for marker in _NOT_A_PLAIN_NUMBER):
        return None
    numbers = _NUMBER.finditer(content)
    first = next(numbers, None)
    if first is None or next(numbers, None) is not None:
        return None  # several numbers: no principled way to pick one
    return _canonical(first)


def _answer_text(text: str) -> str:
    """Raw final-answer text: the line after the last ``####`` if present,
    else the whole text; used where the answer is not a number."""
    pos = text.rfind(_MARKER)
    if pos >= 0:
        text = text[pos + len(_MARKER) :]
    text = text.strip()
    return text.split("\n", 1)[0].strip() if pos >= 0 else text


def _squeeze(s: str) -> str:
    return "".join(s.split())


def _strip_prefix(s: str, prefix: str) -> str:
    return s[len(prefix) :] if s.startswith(prefix) else s


def _strip_suffix(s: str, suffix: str) -> str:
    return s[: -len(suffix)] if s.endswith(suffix) else s
