"""Error types of kvz. One root, one subclass per failure; imports nothing."""


class KvzError(ValueError):
    """Root of every error raised on purpose by kvz."""


class FormatError(KvzError):
    """The bytes are not a valid .kvz file (bad magic, malformed header or index)."""


class TruncatedError(FormatError):
    """The file ends before the data its header and index promise."""


class ChecksumError(FormatError):
    """A stored checksum does not match the bytes it covers."""


class UnsupportedVersionError(FormatError):
    """The file's major version or feature flags are unknown to this reader."""


class BankMismatchError(KvzError):
    """The calibration bank is not the one the file was written with, or does not fit the layout."""


class LayoutError(KvzError):
    """The cache's tensors, shapes or dtypes do not form a layout kvz understands."""


class NonFiniteError(KvzError):
    """The input holds NaN or Inf values (kvz refuses them; see the policy in the README)."""


class EncodeError(KvzError):
    """The encoder could not meet the requested error budget or parameters are invalid."""


class MetadataError(LayoutError):
    """A cache metadata field is malformed or contradicts the tensors (names the field and the fix)."""


class OutputExistsError(KvzError):
    """The output path exists and was not created by this command (pass ``force`` / ``--force``),
    or it is the command's own input."""


class KvzWarning(UserWarning):
    """Something kvz can work with but that costs the user (e.g. compression lost to metadata
    that does not say the keys carry RoPE)."""
