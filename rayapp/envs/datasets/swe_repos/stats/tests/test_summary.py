import unittest

from stats import mean, median, summarize


class MeanMedianTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_median_odd_and_even(self):
        self.assertEqual(median([3, 1, 2]), 2)
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_empty_raises(self):
        with self.assertRaises(ValueError):
            mean([])
        with self.assertRaises(ValueError):
            median([])


class SummarizeTest(unittest.TestCase):
    def test_summary(self):
        self.assertEqual(summarize([3, 1, 2]), {"count": 3, "min": 1, "max": 3, "mean": 2.0, "median": 2})

    def test_accepts_any_iterable(self):
        self.assertEqual(summarize(iter([5]))["median"], 5)

    def test_empty_input(self):
        self.assertEqual(summarize([]), {"count": 0, "min": None, "max": None, "mean": None, "median": None})


if __name__ == "__main__":
    unittest.main()
