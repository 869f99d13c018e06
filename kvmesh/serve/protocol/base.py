"""What every API's request model shares: the base that keeps unknown keys, the refusal a validation
error becomes, and the bounded types the APIs' fields are made of."""

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvmesh.serve.api_errors import ApiError, refuse

# The most tokens a request may ask for (max_tokens and its kin), far past any context.
MAX_TOKENS = 1 << 20
# The most tools and messages a request may carry: each tool is rendered into the prompt, and 20,000
# took the template 8 s and 1.4 GB before the prompt was found too long (OpenAI's own API takes 128
# tools); no conversation a context holds has as many messages.
MAX_TOOLS = 512
MAX_MESSAGES = 100_000

Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=0, lt=1 << 63)]  # what MLX's random seed takes
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Objects = list[dict[str, Any]]


def one_or_many(value: Any) -> Any:
    """A single string where the API takes a string or a list of them, as that list."""
    return [value] if isinstance(value, str) else value


# Stop strings: one, or a list of non-empty ones (each API bounds their count on its field).
StopStrings = Annotated[list[Annotated[str, Field(min_length=1)]], BeforeValidator(one_or_many)]


class Body(BaseModel):
    """A request body (or an object inside one) whose unknown keys are kept, to be named as ignored.
    Strict: a number is not a string, a boolean is not a number."""

    model_config = ConfigDict(extra="allow", strict=True)

    def unknown(self) -> list[str]:
        """The keys this server does not read, sorted."""
        return sorted(self.model_extra or {})


class Closed(BaseModel):
    """An object whose every key is known: any other is refused (not silently dropped)."""

    model_config = ConfigDict(extra="forbid", strict=True)


B = TypeVar("B", bound=BaseModel)
# pydantic's error types that say the value is of the wrong kind, rather than out of bounds.
TYPE_ERRORS = ("_type", "missing", "extra_forbidden", "union_tag_invalid")


def parse(model: type[B], body: dict) -> B:
    """`body` as `model`, or the 400 that names its first wrong field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise refusal(e) from None


def refusal(e: ValidationError) -> ApiError:
    """A validation error as one line a person can act on: "temperature: input should be less than
    or equal to 2, not 3", about the top-level field it is in."""
    first = e.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"]]
    bounds, given = first.get("ctx") or {}, first.get("input")
    if first["type"] == "too_long":
        message = f"at most {bounds['max_length']:,} items, not {bounds['actual_length']:,}"
    elif first["type"] == "too_short":
        message = f"at least {bounds['min_length']:,} item(s), not {bounds['actual_length']:,}"
    else:
        message = first["msg"][:1].lower() + first["msg"][1:]
        if first["type"] != "missing" and isinstance(given, (int, float, str)) and len(repr(given)) <= 60:
            message += f", not {given!r}"
    code = "invalid_type" if first["type"].endswith(TYPE_ERRORS) else "invalid_value"
    return refuse(f"{'.'.join(loc)}: {message}" if loc else message, loc[0] if loc else None, code)
