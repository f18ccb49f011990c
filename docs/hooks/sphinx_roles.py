"""A Griffe extension for the API reference: the docstrings' Sphinx roles become cross-reference links.

ringtrain's docstrings are Google style with reST-flavoured roles (``:class:`TaskSpec```,
``:func:`~ringtrain.comm.allreduce```), which mkdocstrings' Markdown would print as text. Once the
package is loaded, this rewrites each role in every docstring into an optional autoref to the name
resolved in the docstring's own scope (its object, then the enclosing class and module, as Python
would look the name up): a link where the site renders the target, plain code where it does not (a
private module, say), and never a warning. ``mkdocs.yml`` loads it through the python handler's
``extensions`` option; tests/cli/test_docs_site.py fails on any role left in the built site.
"""

import html
import re

import griffe

ROLES = ("class", "func", "mod", "meth", "data", "attr", "exc", "obj")
ROLE = re.compile(r":(?:py:)?(?P<role>" + "|".join(ROLES) + r"):`(?P<target>[^`]+)`")


def shown(target):
    """The text a reader sees: Sphinx's ``~`` keeps the last part of the name, ``!`` the name as given."""
    target = target.lstrip("!")
    if target.startswith("~"):
        return target[1:].rsplit(".", 1)[-1]
    return target.lstrip(".")


# The kind of object each role names, so that `:func:`train`` in a class with a `train` attribute
# still finds the function: a name of the wrong kind is looked up further out, as Sphinx does.
KINDS = {"class": {"class"}, "exc": {"class"}, "func": {"function"}, "meth": {"function"},
         "mod": {"module"}, "attr": {"attribute"}, "data": {"attribute"}}


def _kind(obj, path):
    try:
        return obj.modules_collection[path].kind.value
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


def _lookup(scope, head):
    """``head`` in ``scope``: its own and imported names, then (for a class) inherited members."""
    try:
        return scope.resolve(head)
    except (griffe.NameResolutionError, griffe.AliasResolutionError, KeyError):
        pass
    if scope.is_class:
        try:
            member = scope.all_members.get(head)
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            member = None
        if member is not None:
            return member.path
    return None


def resolve(obj, name, role="obj"):
    """The full path ``name`` stands for in ``obj``'s docstring, or ``name`` itself when none is found."""
    name = name.lstrip("~!").lstrip(".")
    head, _, rest = name.partition(".")
    wanted = KINDS.get(role)
    scope = obj
    while scope is not None:
        path = _lookup(scope, head)
        if path is not None:
            path = f"{path}.{rest}" if rest else path
            if wanted is None or _kind(obj, path) in wanted | {None}:
                return path
        scope = scope.parent
    return name


def rewrite(text, obj):
    """``text`` with each Sphinx role made an optional autoref to the name resolved from ``obj``."""
    def link(match):
        target = match["target"]
        identifier = html.escape(resolve(obj, target, match["role"]), quote=True)
        return f'<autoref identifier="{identifier}" optional><code>{html.escape(shown(target))}</code></autoref>'

    return ROLE.sub(link, text)


def _walk(obj, seen):
    if obj.path in seen or obj.is_alias:
        return
    seen.add(obj.path)
    if obj.docstring is not None and ":" in obj.docstring.value:
        obj.docstring.value = rewrite(obj.docstring.value, obj)
    for member in list(obj.members.values()):
        if not member.is_alias:
            _walk(member, seen)


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring in a package once it is fully loaded."""

    def on_package(self, *, pkg, **kwargs):
        _walk(pkg, set())
