"""The `quantizer` sub-commands: each module parses its flags, calls one library function and prints."""
