import unittest

import app


class AppTest(unittest.TestCase):
    def test_health(self):
        code, body = app.health()
        self.assertEqual(code, 200)
        self.assertEqual(body["status"], "ok")

    def test_revision(self):
        code, body = app.revision()
        self.assertEqual(code, 200)
        self.assertIn("revision", body)


if __name__ == "__main__":
    unittest.main()
