import unittest

from settings import Settings

SAMPLE = """
# service settings
Name = api
port = 9000   # the public port

verbose = yes
cache = off
"""


class ParseTest(unittest.TestCase):
    def test_comments_and_blank_lines_are_skipped(self):
        cfg = Settings.parse(SAMPLE)
        self.assertEqual(cfg.values, {"name": "api", "port": "9000", "verbose": "yes", "cache": "off"})

    def test_keys_are_case_insensitive(self):
        self.assertEqual(Settings.parse(SAMPLE).get("NAME"), "api")

    def test_bad_line_raises(self):
        with self.assertRaises(ValueError):
            Settings.parse("name api")


class GetterTest(unittest.TestCase):
    def setUp(self):
        self.cfg = Settings.parse(SAMPLE)

    def test_get_missing_is_none(self):
        self.assertIsNone(self.cfg.get("host"))
        self.assertEqual(self.cfg.get("host", "localhost"), "localhost")

    def test_get_int(self):
        self.assertEqual(self.cfg.get_int("port"), 9000)
        self.assertEqual(self.cfg.get_int("workers", 4), 4)
        with self.assertRaises(ValueError):
            Settings.parse("port = eighty").get_int("port")

    def test_get_bool_values(self):
        self.assertTrue(self.cfg.get_bool("verbose"))
        self.assertFalse(self.cfg.get_bool("cache"))
        with self.assertRaises(ValueError):
            Settings.parse("debug = maybe").get_bool("debug")

    def test_get_bool_explicit_default(self):
        self.assertTrue(self.cfg.get_bool("color", default=True))

    def test_unset_flag_is_off(self):
        self.assertFalse(self.cfg.get_bool("debug"))


if __name__ == "__main__":
    unittest.main()
