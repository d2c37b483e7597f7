"""Reading a user's JSON file as a JSON object, with the reason it is not one as a phrase the
caller puts in its one-line error (tokenizer directories, Hugging Face model directories).
transformers indexes these files as mappings unchecked (a list: AttributeError "'list' object has
no attribute 'get'"), and json raises for bytes that are not UTF-8, for 3,000 nested arrays
(RecursionError) and for integers past Python's 4,300 digits."""
import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple


def read_json_object(path: Path) -> Tuple[Optional[Dict[str, Any]], str]:
    """(the object, "") or (None, why it is none: "is a list, not a JSON object", ...)."""
    try:
        data = path.read_bytes()
        value = json.loads(data.decode("utf-8"))
    except OSError as e:  # a directory of that name, no permission
        return None, f"cannot be read ({type(e).__name__}: {e.strerror})"
    except UnicodeDecodeError as e:
        return None, f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
    except ValueError as e:  # json.JSONDecodeError; an integer past Python's 4,300 digits
        return None, f"is not valid JSON ({one_line(e)})"
    except RecursionError:  # json.loads recurses per nested array or object
        return None, "is nested too deeply to read as JSON"
    if isinstance(value, dict):
        return value, ""
    return None, f"is {json_kind(value)}, not a JSON object"


def json_kind(value: Any) -> str:
    """What a JSON value is, as a message says it: null, a boolean, a list, a string, a number."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "a list", str: "a string", dict: "a JSON object"}.get(type(value), "a number")


def printable(text: str) -> str:
    """`text` with every control character escaped as Python writes it (a line break as `\\n`, a
    terminal escape as `\\x1b`): a key, path or URL scheme from the user may hold them, and printed
    raw they split the one error line or drive the terminal."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def one_line(error: BaseException) -> str:
    """An exception's message on one line, cut short and escaped (it may quote the file's bytes)."""
    return repr(" ".join(str(error).split())[:200])
