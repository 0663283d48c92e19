"""Tools the tests share that are not tests themselves: drivers and links for tests."""
