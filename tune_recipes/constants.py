"""Values shared by the library's layers; imports nothing, so any module may import it."""

# Label value the loss ignores (padding, masked prompt tokens): torch's and torchtune's default.
CROSS_ENTROPY_IGNORE_INDEX = -100
