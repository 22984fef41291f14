"""Harnesses the tests share and the wheel does not ship: processes and services a test starts around kvstore."""
