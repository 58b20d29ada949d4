import unittest

from slugkit import slugify


class SlugifyTest(unittest.TestCase):
    def test_words_are_joined_by_hyphens(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_punctuation_and_spaces_collapse(self):
        self.assertEqual(slugify("  Hello,   World!  "), "hello-world")

    def test_accents_are_transliterated(self):
        self.assertEqual(slugify("Crème Brûlée"), "creme-brulee")

    def test_numbers_are_kept(self):
        self.assertEqual(slugify("Top 10 tips for 2024"), "top-10-tips-for-2024")

    def test_nothing_left(self):
        self.assertEqual(slugify("!!!"), "")

    def test_long_titles_are_cut(self):
        self.assertEqual(slugify("a" * 80), "a" * 50)
        self.assertEqual(slugify("abcdef", max_length=3), "abc")

    def test_cut_never_ends_with_hyphen(self):
        self.assertEqual(slugify("hello world", max_length=6), "hello")
        self.assertEqual(slugify("The quick brown fox", max_length=10), "the-quick")

    def test_rejects_bad_length(self):
        with self.assertRaises(ValueError):
            slugify("x", max_length=0)


if __name__ == "__main__":
    unittest.main()
