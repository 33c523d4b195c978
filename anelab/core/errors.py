"""One exception type for bad input: the CLI prints its message on one line and exits 2."""


class AnelabInputError(ValueError):
    """Bad input the user can fix. The message is one line and names the fix."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
