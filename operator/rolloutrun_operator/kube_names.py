"""The API server's rules for names and values, with the API server's own messages.

Why: the operator checks every name it derives from a run before any API call
(:mod:`~rolloutrun_operator.name_rules`) and the local cluster refuses what the real API
server refuses (``rolloutrun_localcluster.validation``). Both must agree with the real
server and with each other, so each rule is spelled once, here: the regexes, the length
limits and the messages of Kubernetes' ``k8s.io/apimachinery/pkg/util/validation`` (as of
v0.32, the release of kubectl 1.32), so that an error the local cluster answers reads as the
one a real cluster would answer.

Pure functions: each ``is_*`` returns the list of messages a value breaks (empty when it is
valid), in the order the real server lists them.
"""

from __future__ import annotations

import re

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
DNS1035_LABEL_MAX = 63
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63
PORT_NAME_MAX = 15
TOTAL_ANNOTATION_SIZE = 256 * 1024
"""The sum of the lengths of every annotation key and value of one object, in bytes."""

DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN_FMT = DNS1123_LABEL_FMT + "(\\." + DNS1123_LABEL_FMT + ")*"
DNS1035_LABEL_FMT = "[a-z]([-a-z0-9]*[a-z0-9])?"
QUALIFIED_NAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
LABEL_VALUE_FMT = "(" + QUALIFIED_NAME_FMT + ")?"
ENV_VAR_NAME_FMT = "[-._a-zA-Z][-._a-zA-Z0-9]*"

DNS1123_LABEL = re.compile(DNS1123_LABEL_FMT)
DNS1123_SUBDOMAIN = re.compile(DNS1123_SUBDOMAIN_FMT)
DNS1035_LABEL = re.compile(DNS1035_LABEL_FMT)
QUALIFIED_NAME = re.compile(QUALIFIED_NAME_FMT)
LABEL_VALUE = re.compile(LABEL_VALUE_FMT)
ENV_VAR_NAME = re.compile(ENV_VAR_NAME_FMT)
_PORT_NAME_CHARS = re.compile("[-a-z0-9]+")
_LETTER = re.compile("[a-z]")

_DNS1123_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character"
)
_DNS1123_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character"
)
_DNS1035_LABEL_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with "
    "an alphabetic character, and end with an alphanumeric character"
)
_QUALIFIED_NAME_MSG = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character"
)
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character"
)
_ENV_VAR_NAME_MSG = (
    "a valid environment variable name must consist of alphabetic characters, digits, '_', "
    "'-', or '.', and must not start with a digit"
)


def max_len_error(length: int) -> str:
    return f"must be no more than {length} characters"


def regex_error(message: str, fmt: str, *examples: str) -> str:
    """apimachinery's ``RegexError``, double space before each ``or`` included."""
    if not examples:
        return f"{message} (regex used for validation is '{fmt}')"
    shown = " or ".join(f"'{example}', " for example in examples)
    return f"{message} (e.g. {shown}regex used for validation is '{fmt}')"


def is_dns1123_label(value: str) -> list[str]:
    errors = []
    if len(value) > DNS1123_LABEL_MAX:
        errors.append(max_len_error(DNS1123_LABEL_MAX))
    if not DNS1123_LABEL.fullmatch(value):
        if DNS1123_SUBDOMAIN.fullmatch(value):
            errors.append("must not contain dots")
        else:
            errors.append(regex_error(_DNS1123_LABEL_MSG, DNS1123_LABEL_FMT, "my-name", "123-abc"))
    return errors


def is_dns1123_subdomain(value: str) -> list[str]:
    errors = []
    if len(value) > DNS1123_SUBDOMAIN_MAX:
        errors.append(max_len_error(DNS1123_SUBDOMAIN_MAX))
    if not DNS1123_SUBDOMAIN.fullmatch(value):
        errors.append(regex_error(_DNS1123_SUBDOMAIN_MSG, DNS1123_SUBDOMAIN_FMT, "example.com"))
    return errors


def is_dns1035_label(value: str) -> list[str]:
    errors = []
    if len(value) > DNS1035_LABEL_MAX:
        errors.append(max_len_error(DNS1035_LABEL_MAX))
    if not DNS1035_LABEL.fullmatch(value):
        errors.append(regex_error(_DNS1035_LABEL_MSG, DNS1035_LABEL_FMT, "my-name", "abc-123"))
    return errors


def is_qualified_name(value: str) -> list[str]:
    """Label keys, annotation keys, finalizers: ``[prefix/]name``, the prefix a DNS-1123
    subdomain, the name at most 63 characters."""
    parts = value.split("/")
    errors: list[str] = []
    if len(parts) > 2:
        example = regex_error(
            _QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc"
        )
        return [
            f"a qualified name {example} with an optional DNS subdomain prefix and '/' "
            "(e.g. 'example.com/MyName')"
        ]
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            errors += ["prefix part " + message for message in is_dns1123_subdomain(prefix)]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > QUALIFIED_NAME_MAX:
        errors.append("name part " + max_len_error(QUALIFIED_NAME_MAX))
    if not QUALIFIED_NAME.fullmatch(name):
        errors.append(
            "name part "
            + regex_error(_QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, "MyName", "my.name", "123-abc")
        )
    return errors


def is_label_value(value: str) -> list[str]:
    errors = []
    if len(value) > LABEL_VALUE_MAX:
        errors.append(max_len_error(LABEL_VALUE_MAX))
    if not LABEL_VALUE.fullmatch(value):
        errors.append(
            regex_error(_LABEL_VALUE_MSG, LABEL_VALUE_FMT, "MyValue", "my_value", "12345")
        )
    return errors


def is_port_name(value: str) -> list[str]:
    """A container port's name (an IANA_SVC_NAME, RFC 6335, lowercase only)."""
    errors = []
    if len(value) > PORT_NAME_MAX:
        errors.append(max_len_error(PORT_NAME_MAX))
    if not _PORT_NAME_CHARS.fullmatch(value):
        errors.append("must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)")
    if not _LETTER.search(value):
        errors.append("must contain at least one letter (a-z)")
    if "--" in value:
        errors.append("must not contain consecutive hyphens")
    if value and (value[0] == "-" or value[-1] == "-"):
        errors.append("must not begin or end with a hyphen")
    return errors


def is_env_var_name(value: str) -> list[str]:
    """The strict rule (servers without the RelaxedEnvironmentVariableValidation gate); a
    name it accepts every server accepts."""
    errors = []
    if not ENV_VAR_NAME.fullmatch(value):
        errors.append(
            regex_error(
                _ENV_VAR_NAME_MSG, ENV_VAR_NAME_FMT, "my.env-name", "MY_ENV.NAME", "MyEnvName1"
            )
        )
    if value == ".":
        errors.append("must not be '.'")
    elif value == "..":
        errors.append("must not be '..'")
    elif value.startswith(".."):
        errors.append("must not start with '..'")
    return errors


def is_path_segment_name(value: str) -> list[str]:
    """Names that only need to fit in a URL path (Roles, ClusterRoles and their bindings)."""
    if value in (".", ".."):
        return [f"may not be '{value}'"]
    return [f"may not contain '{bad}'" for bad in ("/", "%") if bad in value]


def mask_trailing_dash(name: str) -> str:
    """A ``generateName`` is checked with its trailing '-' masked (a suffix follows)."""
    if len(name) > 1 and name.endswith("-"):
        return name[:-2] + "a"
    return name
