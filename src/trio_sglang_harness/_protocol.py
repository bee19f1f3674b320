"""How the harness host answers: JSON lines on stdout behind this prefix."""

ANSWER = "TS-HARNESS "
