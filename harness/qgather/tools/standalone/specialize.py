"""A piece's source as a script holds it (qgather.tools.standalone.generate copies the pieces with
inspect.getsource): renamed, its docstring dropped (`source_of`), each `if` on the case's constants
decided (`specialized`), its function-level imports moved to the script's top (`hoisted`)."""

from __future__ import annotations

import ast
import inspect
import re

__all__ = ["hoisted", "source_of", "specialized"]


def specialized(text: str, known: dict[str, object]) -> str:
    """`text` with each `if COND:` block whose condition reads only the case's constants decided:
    dropped when false, its body in its place when true (the script holds only what its case runs;
    the `if`'s comment goes with the body, and what follows a body that returns is dropped)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        match = re.fullmatch(r"(\s*)if (.+?):(\s+#.*)?", lines[i])
        names = match and {n.id for n in ast.walk(ast.parse(match[2], mode="eval")) if isinstance(n, ast.Name)}
        if not match or not names or not names <= known.keys():
            out.append(lines[i])
            i += 1
            continue
        indent = len(match[1])
        end = _block_end(lines, i + 1, indent)
        otherwise = end < len(lines) and lines[end] == f"{match[1]}else:"
        end_else = _block_end(lines, end + 1, indent) if otherwise else end
        taken = eval(match[2], {}, dict(known))  # noqa: S307 -- a condition of the pieces' own source, over literals
        body = lines[i + 1:end] if taken else lines[end + 1:end_else] if otherwise else []
        body = specialized("\n".join(line[4:] for line in body), known).splitlines() if body else []
        if body and taken and match[3]:
            body[0] = _with_comment(body[0], match[3].strip())
        out += body
        i = end_else
        last = next((line for line in reversed(body) if line.strip() and len(line) - len(line.lstrip()) == indent), "")
        if re.match(r"\s*(return|raise)\b", last):
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) >= indent):
                i += 1  # unreachable after the body's return
    return "\n".join(out) + "\n"


def _with_comment(line: str, comment: str) -> str:
    """`line` carrying `comment` (the decided `if`'s why), or the comment above it when that is too long."""
    if "#" not in line and len(line) + len(comment) + 2 <= 120:
        return f"{line}  {comment}"
    return f"{' ' * (len(line) - len(line.lstrip()))}{comment}\n{line}"


def hoisted(texts: list[str]) -> tuple[list[str], list[str]]:
    """The texts without their function-level imports (a blank line after them goes too), and those
    imports, to stand at the top of the script (the carried `qref` package's stay: it is installed
    at run time)."""
    imports, out = [], []
    for text in texts:
        lines, kept = text.splitlines(), []
        for index, line in enumerate(lines):
            stripped = line.strip()
            if line.startswith(" ") and re.match(r"(import|from) (?!qref)[\w.]+", stripped):
                imports += [stripped] if stripped not in imports else []
                if index + 1 < len(lines) and not lines[index + 1].strip():
                    lines[index + 1] = "\0"  # the blank line after the imports
                continue
            if line != "\0":
                kept.append(line)
        out.append("\n".join(kept) + "\n")
    return out, imports


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """The index after the block that starts at `start`, indented deeper than `indent`."""
    end = start
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    while end > start and not lines[end - 1].strip():  # a blank line after a block belongs to what follows
        end -= 1
    return end


def source_of(function, name: str) -> str:
    """The function's source as the script holds it: named `name`, without its docstring (a `# why`
    comment stays) and without the pieces' ruff pragmas."""
    text = inspect.getsource(function)
    tree = ast.parse(text)
    node = tree.body[0]
    lines = text.splitlines()
    first = ast.get_docstring(node, clean=False) is not None and node.body[0]
    if first:
        del lines[first.lineno - 1:first.end_lineno]
        if lines[first.lineno - 1:first.lineno] == [""]:  # the blank line after a docstring goes too
            del lines[first.lineno - 1]
    text = re.sub(r"# noqa: [A-Z0-9, ]+(-- )?", "# ", "\n".join(lines) + "\n")  # the comment's why stays
    return text.replace(f"def {function.__name__}(", f"def {name}(", 1)
